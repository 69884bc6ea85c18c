"""Greedy tokens through a running cluster and from transformers, for the e2e tests that compare them."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from tokenmill.client import Client


def cluster_greedy(address: str, prompts: tuple[str, ...], new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(each prompt's token ids, its greedy continuation, EOS ignored), the requests sent at once so their decode
    steps share batches."""
    with Client(address, timeout=120) as client:
        prompt_ids = [client.tokenize(prompt) for prompt in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: client.generate(p, max_tokens=new_tokens, temperature=0,
                                                              ignore_eos=True), prompts))
    return prompt_ids, [list(result.token_ids) for result in results]


def transformers_greedy(hf_model, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        return hf_model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
