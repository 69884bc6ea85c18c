"""`tokenmill accuracy` on a tiny model folder: the table it prints, read back."""
from __future__ import annotations

from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.bench.accuracy import main


def test_accuracy_table_compares_every_variant_with_the_float32_reference(tmp_path, capsys):
    folder, _ = make_tiny_hf_model(tmp_path, "llama")
    assert main(["--model", str(folder), "--positions", "120", "--window", "40"]) == 0
    out, err = capsys.readouterr()
    assert int(err.split(" positions in")[0].split()[-1]) >= 120  # at least what --positions asked for
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    table = {(r[0].strip(), r[1].strip()): [c.strip() for c in r[2:]] for r in rows}
    assert len(table) == 13  # with the three "on the file's blocks" rows (floats here: a folder has no blocks)
    reference = table[("reference: dequantized", "float32")]
    # a folder's weights are floats: "as the file holds it" in float32 is the reference itself
    assert reference[2:] == table[("as the file holds it", "float32")][2:]
    assert reference[2] == "100.00%" and reference[4] == "+0.000"
    int4, int8 = table[("int4 at load (group 32)", "float32")], table[("int8 at load (group 32)", "float32")]
    assert int4[0] == "int4 (quantized at load)" and int8[0] == "int8 (quantized at load)"
    assert float(int4[1]) < float(int8[1]) < float(reference[1])  # weight MiB
    # int8 stays closer to the reference than int4 (random tiny weights: int4's error is large)
    assert abs(float(int8[4])) <= abs(float(int4[4])) and int4[4] != "+0.000"
    assert float(int8[2].rstrip("%")) >= float(int4[2].rstrip("%"))
    # quantized KV pages (a token a pass, reading K/V back from the pages): close to the reference, not equal to it
    kv_int8 = table[("dequantized, KV pages in int8 (a token a pass)", "float32")]
    kv_fp8 = table[("dequantized, KV pages in fp8_e4m3 (a token a pass)", "float32")]
    assert kv_int8[1] == reference[1]  # the same weights
    assert float(kv_int8[2].rstrip("%")) >= 90 and float(kv_fp8[2].rstrip("%")) >= 80
    assert kv_int8[4] != "+0.000" and abs(float(kv_int8[4])) <= abs(float(kv_fp8[4])) + 0.05


def test_the_corpus_is_the_prose_and_the_checkouts_files():
    """The files are found from the checkout's root (they were looked for under tokenmill/ once the bench
    moved into tokenmill/bench, and the corpus shrank to the prose alone)."""
    from tokenmill.bench.int8_agreement import CHECKOUT, REPO_FILES, corpus

    texts = corpus(CHECKOUT)
    assert len(texts) == 1 + len(REPO_FILES) and (CHECKOUT / "README.md").read_text() in texts


def test_passes_of_any_row_count_give_the_window_s_logits(tmp_path):
    """The float32 reference run a token at a time, 16 rows a pass (a chunked prefill after the earlier chunks'
    KV) and a whole window at once: the same logits up to float32 summation order."""
    import torch

    from tokenmill.bench.int8_agreement import window_logits
    from tokenmill.bench.accuracy import decode_logits
    from worker.loader import load_model

    folder, _ = make_tiny_hf_model(tmp_path, "llama")
    model, config = load_model(folder, dtype=torch.float32, progress=False)
    ids = list(range(5, 45))  # 40 tokens: 2 full passes of 16 and one of 8
    whole = window_logits(model, config, ids, torch.float32, torch.device("cpu"))
    for rows in (1, 16):
        torch.testing.assert_close(decode_logits(model, config, ids, torch.float32, torch.device("cpu"), rows), whole,
                                   rtol=1e-4, atol=1e-4)
