"""Driver for tests/e2e/test_e2e_mp_vllm.py and test_e2e_model_build.py, run by the python
of the vLLM environment as ``python -m support.e2e_vllm_driver`` (tests/ on ``PYTHONPATH``).

``build-model OUT [--seed N] [--layers L --hidden H --heads A --kv-heads K --max-len N]``: a
random-weight Llama (default tiny: 2 layers, hidden 128, 4 heads, 2 KV heads; the end-to-end
benchmark, bench/bench_e2e.py, asks for a realistic shape) and a byte-level BPE tokenizer
trained here, saved with ``save_pretrained`` -- nothing is downloaded.  ``--seed`` (default
0) draws the weights only: another seed into the same directory replaces the weights with
others of the same shapes and file size, and rewrites the tokenizer and config as they were.

``run``: a real vLLM ``LLM`` with ``LMCacheMPConnector`` against a running
``lmcache server``; prints one JSON line with what each request saw.
Phase ``cold``: warm-up, cold prompt, wait for the server to persist it,
``POST /cache/clear`` (L1), repeat.  Phase ``restart``: a fresh engine against a
restarted server, same prompt.  ``--cold-reference``: then the prompt once more under a
fresh ``cache_salt`` (keys no chunk stored before has): a cold run of these weights in the
same engine, reported as ``reference``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from support import reports
from support.mp_server import adapter_status, clear_l1, wait_persisted

for _k, _v in {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1",
               "LMCACHE_DISABLE_BANNER": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
    os.environ.setdefault(_k, _v)

VOCAB = 512
PROMPT_TOKENS = 700  # two full 256-token chunks (512 tokens) and a partial one
WARMUP_TOKENS = 200  # less than a chunk: stores nothing
LOGPROBS = 20


def build_model(out: Path, seed: int = 0, layers: int = 2, hidden: int = 128, heads: int = 4,
                kv_heads: int = 2, max_len: int = 2048) -> None:
    import random

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["kv", "cache", "nvme", "chunk", "token", "layer", "head", "page", "block", "drive",
             "read", "write", "store", "load", "hit", "miss", "tier", "host", "gpu", "file"]
    corpus = [" ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(40))
              for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_len,
                         bos_token_id=1, eos_token_id=2,
                         pad_token_id=3, tie_word_embeddings=False, initializer_range=0.2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


def run(model: str, port: int, http: str, phase: str, cold_reference: bool = False
        ) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, tokenizer=model, dtype="bfloat16", enforce_eager=True,
              max_model_len=2048, enable_prefix_caching=False, seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="LMCacheMPConnector", kv_role="kv_both",
                  kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1",
                                             "lmcache.mp.port": port,
                                             "lmcache.mp.mq_timeout": 30}))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=LOGPROBS)
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])

    def ask(tokens: list[int], cache_salt: str | None = None) -> dict[str, Any]:
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        first = out.outputs[0].logprobs[0]
        return {"num_cached_tokens": int(out.num_cached_tokens or 0),
                "token": int(out.outputs[0].token_ids[0]),
                "logprobs": {str(t): float(lp.logprob) for t, lp in first.items()}}

    report: dict[str, Any] = {"phase": phase}
    warmup_seed = 99 if phase == "cold" else 98
    report["warmup"] = ask(_prompt(seed=warmup_seed, n=WARMUP_TOKENS, vocab=vocab))
    prompt = _prompt(seed=7, n=PROMPT_TOKENS, vocab=vocab)
    report["status_before"] = adapter_status(http)
    if phase == "cold":
        report["cold"] = ask(prompt)
        report["status_stored"] = wait_persisted(http, PROMPT_TOKENS // 256)
        report["clear"] = clear_l1(http)
    report["hit"] = ask(prompt)
    if cold_reference:
        report["reference"] = ask(prompt, cache_salt=f"cold-reference-{os.getpid()}")
    report["status_after"] = adapter_status(http)
    llm.llm_engine.engine_core.shutdown()  # else its message queues stay in /dev/shm
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-model")
    b.add_argument("out", type=Path)
    b.add_argument("--seed", type=int, default=0)
    for shape, default in (("layers", 2), ("hidden", 128), ("heads", 4), ("kv-heads", 2),
                           ("max-len", 2048)):
        b.add_argument(f"--{shape}", type=int, default=default)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--http", required=True)
    r.add_argument("--phase", choices=["cold", "restart"], required=True)
    r.add_argument("--cold-reference", action="store_true")
    args = parser.parse_args()
    if args.cmd == "build-model":
        build_model(args.out, args.seed, args.layers, args.hidden, args.heads, args.kv_heads,
                    args.max_len)
        reports.emit({"built": str(args.out)})
    reports.emit(run(args.model, args.port, args.http, args.phase, args.cold_reference))


if __name__ == "__main__":
    main()
