"""bf16 over fp32 at several step shapes, as cpuspeed.measure_bf16_over_fp32 times them (three repeats each)."""
from tunebench.machine import cpuspeed

for shape in ((512, 1024, 2816), (512, 576, 1536), (384, 576, 576), (1024, 2048, 5632)):
    cpuspeed.BF16_STEP_SHAPE = shape
    print(shape, [cpuspeed.measure_bf16_over_fp32(2) for _ in range(3)], flush=True)
