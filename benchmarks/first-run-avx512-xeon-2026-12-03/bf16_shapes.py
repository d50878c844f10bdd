"""bf16 over fp32 at several step shapes, as hardware.measure_bf16_over_fp32 times them (three repeats each)."""
from tunebench.machine import hardware

for shape in ((512, 1024, 2816), (512, 576, 1536), (384, 576, 576), (1024, 2048, 5632)):
    hardware.BF16_STEP_SHAPE = shape
    print(shape, [hardware.measure_bf16_over_fp32(2) for _ in range(3)], flush=True)
