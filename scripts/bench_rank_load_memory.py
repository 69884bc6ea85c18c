"""What one tensor-parallel rank's load costs in host memory: a share read as such from a Hugging Face folder
(worker/loader/share.py) against the whole model loaded and then split (docs/benchmarks.md).

A random Llama (hidden 1,024, 4 layers, 32k vocabulary, untied: 482 MiB of float32) is written once to a temp
folder; each way then loads it in a fresh process as rank 1 of N (building a share needs no collective) and
prints the growth of anonymous memory (RssAnon, sampled every 2 ms: the process's own, unlike the page cache
of the mapped file, which the ranks of one machine share) at its peak and once loaded, beside the bytes the
share holds.

    .venv/bin/python scripts/bench_rank_load_memory.py [--sizes 2,4]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def anon_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")


def measure(folder: Path, how: str, size: int) -> None:
    """One load in this process; prints 'peak now held' in MiB."""
    import torch

    sys.path.insert(0, str(ROOT))
    from worker.loader import load_model
    from worker.parallel.group import TensorParallelGroup
    from worker.parallel.ranks import Parallel

    base, peak, done = anon_kib(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_kib())
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()
    parallel = Parallel(TensorParallelGroup(1, size, None), channel=None)
    if how == "share":
        share, config = load_model(folder, dtype=torch.float32, progress=False, share_of=parallel.share_of(folder))
        model = parallel.wrap(share, config)
    else:
        whole, _ = load_model(folder, dtype=torch.float32, progress=False)
        model = parallel.split(whole)
        del whole
    done.set()
    time.sleep(0.01)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"{(peak[0] - base) / 1024:.0f} {(anon_kib() - base) / 1024:.0f} {held / 2**20:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,4", help="tensor-parallel sizes (comma-separated)")
    parser.add_argument("--measure", nargs=3, metavar=("FOLDER", "HOW", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(Path(args.measure[0]), args.measure[1], int(args.measure[2]))
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        config = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                             num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(folder)
        print("| rank 1 of N | load | peak anonymous growth (MiB) | once loaded (MiB) | the share holds (MiB) |")
        print("| --- | --- | --- | --- | --- |")
        for size in (int(value) for value in args.sizes.split(",")):
            for how in ("share", "whole then split"):
                out = subprocess.run([sys.executable, __file__, "--measure", folder, how.split()[0], str(size)],
                                     check=True, capture_output=True, text=True).stdout.split()
                print(f"| {size} | {how} | {out[0]} | {out[1]} | {out[2]} |")


if __name__ == "__main__":
    main()
