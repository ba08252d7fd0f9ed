"""The bandwidth ceiling of an in-place read-modify-write pass, the decode kernel's traffic pattern.

Decode reads every state of the pool once and writes it back (plus a few KB of q/k/v/g per head). The best a
kernel can do is what a plain elementwise in-place pass reaches on the same bytes; this script measures that
with torch (mul_, add_ of a scalar; fp32 and bf16 pools of the decode benchmark's sizes) and a copy into a
second buffer for comparison. CUDA events, medians of 50 after 10 warm-up calls; bytes = read + write.
    python3 bench/rmw_ceiling.py
"""
import torch


def time_ms(fn, iters=50, warm=10):
    for _ in range(warm):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2]


def main():
    print(torch.cuda.get_device_name(), flush=True)
    print(f"{'pool':>28} {'op':>8} {'MB':>8} {'us':>9} {'TB/s':>6}")
    for n, h, dtype in [(256, 32, torch.float32), (256, 32, torch.bfloat16), (32, 32, torch.float32),
                        (1024, 32, torch.bfloat16)]:
        x = torch.randn(n, h, 128, 128, device="cuda").to(dtype)
        y = torch.empty_like(x)
        mb = x.numel() * x.element_size() / 1e6
        for name, fn in [("mul_", lambda: x.mul_(1.0)), ("add_", lambda: x.add_(0.0)),
                         ("copy", lambda: y.copy_(x))]:
            ms = time_ms(fn)
            print(f"{f'N{n} H{h} K=V=128 {str(dtype)[6:]}':>28} {name:>8} {mb:8.1f} {ms * 1e3:9.1f} "
                  f"{2 * mb / 1e6 / (ms / 1e3):6.2f}", flush=True)


if __name__ == "__main__":
    main()
