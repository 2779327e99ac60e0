# The CUDA process of `gpu-check` (PyTorch): allocates, tries allocations, keeps the card busy and
# says what it saw as one JSON object per line on stdout. Its one argument is a JSON object:
#   {"alloc_mib": N,        memory held from start to end (0: none)
#    "try_mib": [N, ...],   allocations tried one by one (each freed at once); their outcome is told
#    "load_s": S,           seconds of half-precision matrix products after the allocations
#    "hold_s": S}           seconds to sleep after the load, still holding the context
import json
import os
import sys
import time

start = time.time()


def say(event, **fields):
    fields["event"] = event
    fields["t"] = round(time.time() - start, 3)
    print(json.dumps(fields), flush=True)


try:
    spec = json.loads(sys.argv[1])
    import torch

    t0 = time.time()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    env = {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "NVIDIA_"))}
    say(
        "init",
        pid=os.getpid(),
        uid=os.getuid(),
        cuda_init_s=round(time.time() - t0, 3),
        free_mib=free >> 20,
        total_mib=total >> 20,
        sms=props.multi_processor_count,
        name=props.name,
        cc=f"{props.major}.{props.minor}",
        env=env,
    )
    held = None
    if spec.get("alloc_mib", 0) > 0:
        held = torch.empty(spec["alloc_mib"] << 20, dtype=torch.uint8, device="cuda")
        held.fill_(1)
        torch.cuda.synchronize()
        say("alloc", mib=spec["alloc_mib"], ok=True)
    for mib in spec.get("try_mib", []):
        try:
            x = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
            x.fill_(1)
            torch.cuda.synchronize()
            del x
            torch.cuda.empty_cache()
            say("try", mib=mib, ok=True)
        except Exception as e:  # torch.OutOfMemoryError, or a CUDA error under MPS
            torch.cuda.empty_cache()
            say("try", mib=mib, ok=False, error=str(e).splitlines()[0][:300])
    load = spec.get("load_s", 0)
    products = 0
    if load > 0:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        say("loaded")
        until = time.time() + load
        while time.time() < until:
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            products += 8
    if spec.get("hold_s", 0) > 0:
        time.sleep(spec["hold_s"])
    say("done", products=products)
except Exception as e:
    say("error", error=f"{type(e).__name__}: {e}"[:500])
    sys.exit(1)
