# one GRPO/RFT-shaped probe (4 rows x 1024, SmolLM2-135M LoRA fp32, tunebench kernel): VmHWM/RSS after each repeat
import os, sys, time, torch, peft
from transformers import AutoModelForCausalLM
from tunebench.model import kernels
from tunebench.training.preference import token_logps
def st(k):
    for l in open('/proc/self/status'):
        if l.startswith(k): return int(l.split()[1])//1024
torch.manual_seed(0)
m = AutoModelForCausalLM.from_pretrained('/work/arms/seed1/start', torch_dtype=torch.float32)
m = peft.get_peft_model(m, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=['q_proj','v_proj']))
kernels.register(); m.set_attn_implementation(sys.argv[1] if len(sys.argv) > 1 else kernels.NAME)
m.train()
ids = torch.randint(0, 49000, (4, 1024))
index = torch.cat([torch.arange(r*1023+700, r*1023+1000) for r in range(4)])
import ctypes; ctypes.CDLL(None).malloc_trim(0)
open('/proc/self/clear_refs','w').write('5')
print('tunables', os.environ.get('GLIBC_TUNABLES','-'), 'start rss', st('VmRSS'), flush=True)
for i in range(3):
    t=time.time()
    lp = token_logps(m, {'input_ids': ids}, index, None)
    (-lp.mean()).backward()
    print(i, f'{time.time()-t:.1f}s', 'hwm', st('VmHWM'), 'rss', st('VmRSS'), flush=True)
m.zero_grad(set_to_none=True)
