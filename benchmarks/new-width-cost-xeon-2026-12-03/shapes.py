"""Does a micro batch of a width not seen before in the process cost more than one seen before? SmolLM2-135M LoRA r8
q/v, fp32, forward+backward, 2 threads: after 3 warm steps at the widest width (as the probe runs it), each new
width three times in a row (first sight, then twice again). Run under tunebench's malloc tunables (GLIBC_TUNABLES,
as a tunebench process runs) and without, micro 1 and 4."""
import statistics
import sys
import time

import lora_model
import torch

m = lora_model.load()
micro = int(sys.argv[1])
def step(w):
    x = torch.randint(0, 40000, (micro, w))
    t = time.perf_counter()
    out = m(input_ids=x, labels=x)
    out.loss.backward()
    m.zero_grad(set_to_none=True)
    return time.perf_counter() - t
for w in (128, 128, 128):
    step(w)
firsts, agains = [], []
for w in (97, 83, 111, 64, 120, 75, 101, 90, 58, 125, 70, 106):
    a, b, c = step(w), step(w), step(w)
    firsts.append(a); agains.append(min(b, c))
    print(f"micro {micro} width {w:4d}: first {a*1000:7.1f} ms, again {b*1000:7.1f}, {c*1000:7.1f}  first - again "
          f"{(a - min(b, c))*1000:6.1f} ms ({a/min(b,c):.2f}x)", flush=True)
d = [a - b for a, b in zip(firsts, agains)]
print(f"micro {micro}: a new width's extra: median {statistics.median(d)*1000:.1f} ms, mean {statistics.mean(d)*1000:.1f};"
      f" steady step median {statistics.median(agains)*1000:.1f} ms")
