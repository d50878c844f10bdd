"""Models and what is done to them: presets and loading, the pretraining architectures, training methods
(PEFT, quantization), hand-written kernels, inference as it trained, GGUF writing, task quality.
Imports core, machine, settings and data."""
