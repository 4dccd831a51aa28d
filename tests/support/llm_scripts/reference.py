"""Run inside an exporter's virtual environment (torch and transformers): transformers' own f32
greedy answers to the prompts, with per-token logprobs, written as JSON.

    python reference.py HF_DIR PROMPTS_JSON MAX_NEW_TOKENS OUT_JSON

For each prompt: the prompt's ids (a raw prompt tokenized as the tokenizer does by default, so
with its BOS if it adds one; a chat rendered by the folder's template and tokenized without
special tokens, as ``apply_chat_template`` does); ``MAX_NEW_TOKENS`` greedy ids that go on past
an EOS (``ignore_eos``); where the first EOS falls (``stop``: generation without ignore_eos ends
after ``ids[:stop]``, the EOS included); each chosen token's logprob and the top 5; the logprob of
each prompt token after the first; and the smallest gap between the best and second-best logit
over the steps (how far the greedy choice is from a tie). The greedy loop is checked against
``model.generate(do_sample=False)``, which stops at the EOS.
"""

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

TOP = 5


def main(folder: str, prompts_path: str, max_new: str, out_path: str) -> None:
    torch.manual_seed(0)
    max_new_tokens = int(max_new)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"{folder}: transformers did not load every weight: {bad}")
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    cases = []
    for case in json.loads(Path(prompts_path).read_text()):
        if "messages" in case:
            text = tokenizer.apply_chat_template(
                case["messages"], tokenize=False, add_generation_prompt=True
            )
            prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
            via = tokenizer.apply_chat_template(
                case["messages"], tokenize=True, add_generation_prompt=True
            )
            via = via["input_ids"] if isinstance(via, dict) or hasattr(via, "keys") else via
            if list(via) != prompt_ids:
                raise SystemExit(f"{case['name']}: apply_chat_template ids differ: {via}")
        else:
            text = case["prompt"]
            prompt_ids = tokenizer(text).input_ids
        cases.append({**case, "text": text, **greedy(model, prompt_ids, max_new_tokens, eos)})
        result = cases[-1]
        end = result["stop"] if result["stop"] is not None else max_new_tokens
        result["completion"] = tokenizer.decode(result["ids"][:end], skip_special_tokens=True)
        result["completion_ignore_eos"] = tokenizer.decode(result["ids"], skip_special_tokens=True)
        check_generate(model, prompt_ids, result["ids"][:end], max_new_tokens, eos, case["name"])
    result = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "max_new_tokens": max_new_tokens,
        "eos_token_ids": eos,
        "cases": cases,
    }
    Path(out_path).write_text(json.dumps(result, indent=1))


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: list[int]) -> dict:
    ids = torch.tensor([prompt_ids])
    out = model(input_ids=ids, use_cache=True)
    prompt_lp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
    prompt_logprobs = [None] + [float(prompt_lp[i, t]) for i, t in enumerate(prompt_ids[1:])]
    past, logits = out.past_key_values, out.logits[0, -1]
    chosen, logprobs, tops, margin, stop = [], [], [], float("inf"), None
    for step in range(max_new_tokens):
        lp = torch.log_softmax(logits.float(), dim=-1)
        best = torch.topk(logits, 2)
        margin = min(margin, float(best.values[0] - best.values[1]))
        token = int(best.indices[0])
        top = torch.topk(lp, TOP)
        chosen.append(token)
        logprobs.append(float(lp[token]))
        tops.append([[int(i), float(v)] for v, i in zip(top.values, top.indices)])
        if stop is None and token in eos:
            stop = step + 1
        out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return {
        "prompt_ids": prompt_ids,
        "prompt_logprobs": prompt_logprobs,
        "ids": chosen,
        "stop": stop,
        "logprobs": logprobs,
        "top_logprobs": tops,
        "min_margin": margin,
    }


@torch.no_grad()
def check_generate(model, prompt_ids, expected, max_new_tokens, eos, name) -> None:
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )
    got = out[0, len(prompt_ids) :].tolist()
    if got != expected:
        raise SystemExit(f"{name}: generate() gave {got}, the greedy loop {expected}")


if __name__ == "__main__":
    main(*sys.argv[1:])
