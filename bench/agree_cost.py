"""What the ranks' agreement check (ringfa4.ring.agree) costs, against a ring call at 16k tokens.

    torchrun --nproc_per_node=2 bench/agree_cost.py      # over NCCL on 2 GPUs: the exchange included
    torchrun --nproc_per_node=1 bench/agree_cost.py      # one GPU: a one-rank group, no exchange
    torchrun --nproc_per_node=2 bench/agree_cost.py --smoke   # CPU, gloo

Three numbers per rank count: the check of a signature the group agreed on before (every call
after the first: host time of one tuple and one set lookup), the first check of a signature
(signature on the device, q's fingerprint, the all-gathers, one copy to the host: wall time
with the device synchronised before and after), and one ring fwd+bwd call (bench/measure.Timer)
and its step (the call / 2W). The check runs once per ring_attention call, so the first number
against a call is its steady-state share; the second is paid once per new shape.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ringfa4  # noqa: E402
from ringfa4.ring import agree  # noqa: E402
from ringfa4.train import launch  # noqa: E402

import measure  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_check_ms(q, k, device, repeats):
    times = []
    for _ in range(repeats):
        agree._agreed.clear()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        agree.check(q, k, True, "zigzag", q.shape[-1] ** -0.5, False, None, None)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _cached_check_us(q, k, calls):
    start = time.perf_counter()
    for _ in range(calls):
        agree.check(q, k, True, "zigzag", q.shape[-1] ** -0.5, False, None, None)
    return (time.perf_counter() - start) * 1e6 / calls


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", default="32:8")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu") if smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if smoke else "nccl", **({} if smoke else dict(pg_options=ringfa4.nccl_options())))
    world = dist.get_world_size()
    h, hk = map(int, args.heads.split(":"))
    seq, d, dtype = (256, 32, torch.float32) if smoke else (args.seq, 128, torch.bfloat16)
    q, k, v, dout = (ringfa4.shard(torch.randn(1, seq, n, d, device=device, dtype=dtype, generator=torch.Generator(
        device=device).manual_seed(i))).requires_grad_() for i, n in enumerate((h, hk, hk, h)))

    def ring_call():
        out = ringfa4.ring_attention(q, k, v, causal=True, backend="torch" if smoke else "auto")
        torch.autograd.grad(out, (q, k, v), dout)

    call_ms = measure.Timer(device, rounds=3, warmup=1, group=dist.group.WORLD)(ring_call)[0]
    first_ms = _first_check_ms(q.detach(), k.detach(), device, repeats=5)
    cached_us = _cached_check_us(q.detach(), k.detach(), calls=10000)
    step_ms = call_ms / (2 * world)
    if dist.get_rank() == 0:
        print(f"{measure.metadata(device)['device']}, W={world}, seq {seq}, heads {h}/{hk}, head_dim {d}, {dtype}")
        print(f"ring fwd+bwd call {call_ms:.3f} ms, one ring step {step_ms:.3f} ms (call / 2W)")
        print(f"agreed signature: {cached_us:.2f} us per call = {cached_us / 1e3 / call_ms:.3%} of a call, "
              f"{cached_us / 1e3 / step_ms:.3%} of a step")
        print(f"first check of a signature ({'no exchange: one rank' if world == 1 else f'{world} ranks'}): "
              f"{first_ms:.3f} ms = {first_ms / call_ms:.1%} of a call, once per new shape")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    if launch.under_torchrun():  # a rank ends as the trainer's do (see launch.end_process)
        launch.end_process()
