"""What a worker process imports as it starts: not torch._dynamo and inductor (llguidance.torch's module-level
torch.compile pulled them in, 2.7 s of each worker's start and restart before they were left out)."""
import subprocess
import sys


def test_starting_a_worker_does_not_import_the_torch_compiler():
    code = "import sys, worker.main; print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout[:300]
