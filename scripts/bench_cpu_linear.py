"""Every linear of the default model at a few row counts: nn.Linear vs worker.linears.packed.PackedLinear.

Not a test: prints milliseconds for one pass over all 30 layers' linears plus the lm_head (what one
step multiplies), the two variants interleaved round by round so machine noise hits both alike.
    python3 scripts/bench_cpu_linear.py --rows 1 8 32 512
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from worker.linears.packed import pack_linears
from worker.loader import load_model


def linears(model: nn.Module) -> list[nn.Module]:
    return [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in
            ("wqkv", "wo", "w_gate_up", "w_down", "lm_head")]


@torch.inference_mode()
def one_pass(modules: list[nn.Module], inputs: dict[int, torch.Tensor]) -> float:
    started = time.perf_counter()
    for module in modules:
        module(inputs[module.in_features])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    model, _ = load_model(None, torch.float32, progress=False)
    packed = copy.deepcopy(model)
    pack_linears(packed)
    variants = {"nn.Linear": linears(model), "packed": linears(packed)}
    print(f"threads={torch.get_num_threads()}, {len(variants['packed'])} linears per pass")
    print(f"{'rows':>6}{'nn.Linear ms':>14}{'packed ms':>11}{'speedup':>9}")
    for rows in args.rows:
        inputs = {size: torch.randn(rows, size) for size in (model.config.hidden_size, model.config.intermediate_size)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(args.rounds + 1):
            for name, modules in variants.items():
                elapsed = one_pass(modules, inputs)
                if round_:  # the first round warms both up
                    times[name].append(elapsed)
        plain, fast = (statistics.median(times[name]) * 1e3 for name in variants)
        print(f"{rows:>6}{plain:>14.1f}{fast:>11.1f}{plain / fast:>8.2f}x")


if __name__ == "__main__":
    main()
