import time, torch, ctypes
from asyncpin._cudart import Runtime
rt = Runtime()
kv = [torch.empty(2, 64, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(32)]
arrays = [t[i] for t in kv for i in range(2)]
storages = [a.untyped_storage() for a in kv]
ptrs = [s.data_ptr() for s in storages]
def t(name, f, n=2000):
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    print(f"{name:40} {(time.perf_counter()-t0)/n*1e6:8.2f} us")
t("32 storages data_ptr", lambda: [s.data_ptr() for s in storages] == ptrs)
t("64 arrays data_ptr", lambda: [a.data_ptr() for a in arrays])
t("getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(0))
s = torch._C._cuda_getCurrentRawStream(0)
t("rt.capturing(current)", lambda: rt.capturing(s))
side = torch.cuda.Stream()
t("rt.capturing(side)", lambda: rt.capturing(side.cuda_stream))
t("torch is_current_stream_capturing", torch.cuda.is_current_stream_capturing)
