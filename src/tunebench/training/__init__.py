"""How a run is trained: the loop, optimizer and schedule, checkpoints, preference losses, the measured
decisions (tune/), the run plan and the core both jobs call (runner). Imports the layers below."""
