"""A generative model folder whose decoder writes a fixed answer: for tests of what the server
reads out of answers (tool calls, reasoning) that a random-weight model never writes.

Each family (:data:`FAMILIES`) is a chat template in that family's published format (written
here, shortened: the system text is ours, the markup is the family's), its special and added
tokens as the family's tokenizer has them (Qwen's ``<tool_call>`` and ``<think>`` are added
tokens, not special; Llama's ``<|python_tag|>`` and Mistral's ``[TOOL_CALLS]`` are special),
and a byte-level BPE tokenizer trained (tests/support/llm_bpe.py, deterministic) on the
template and the scripts, so a marker is one token where the family's is and text splits into
multi-character tokens as a real tokenizer's does.

The decoder (an ONNX graph, as optimum exports one: it loads as a ConcatDecoder on any device)
counts positions from the last *anchor* token of the prompt (the token the family's generation
prompt starts with: ``<|im_start|>``, ``<|end_header_id|>``, ``[/INST]``...), through its
key/value cache (each position caches ``position + 1`` where its token is an anchor, else 0;
the anchor is the cache's maximum; only a prefill's tokens count, so a generated anchor, as
gpt-oss writes ``<|start|>`` between its messages, does not), and gives the script's next
token a logit of 0 and every other -10000: greedy or not, the answer is the script then the
end of sequence, whatever the chat before it.
"""

# DeepSeek's tokens are written with full-width bars, as its tokenizer has them
# ruff: noqa: RUF001

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
from tiny_decoder import HEAD, optimum_interface

__all__ = ["FAMILIES", "Family", "write"]


QWEN = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful \
assistant.{% endif %}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or \
(message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %}
{{ message.content }}{% endif %}
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{# THINK #}{% endif %}"""

#: Qwen3's generation prompt: an empty thought when thinking is off
QWEN3_THINK = """{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}"""

QWEN3_CODER = """{%- if tools %}<|im_start|>system
You are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.

# Tools

You have access to the following functions:

<tools>{% for tool in tools %}
<function>
<name>{{ tool.function.name }}</name>
<parameters>{{ tool.function.parameters | tojson }}</parameters>
</function>{% endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for tc in message.tool_calls %}
<tool_call>
<function={{ tc.function.name }}>
{% for key, value in tc.function.arguments | items %}<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{{- bos_token }}<|start_header_id|>system<|end_header_id|>

Environment: ipython
Cutting Knowledge Date: December 2023

{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>
{%- for message in messages if message.role != 'system' %}
{%- if loop.first and tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and \
its value}. Do not use variables.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls %}\
<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}<|python_tag|>{"name": "{{ tc.function.name }}", \
"parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{{- bos_token }}{% for message in messages %}
{%- if message.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]\
{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][\
{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": \
{{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}\
{% endfor %}]{{ eos_token }}
{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- endif %}{% endfor %}"""

LLAMA4 = """{{- bos_token }}{% if tools %}<|header_start|>system<|header_end|>

You are an expert in composing functions. If you decide to invoke any of the function(s), you \
MUST put it in the format of [func_name1(params_name1=params_value1, \
params_name2=params_value2...), func_name2(params)]
You SHOULD NOT include any other text in the response if you call a function.
{{ tools | tojson }}<|eot|>{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}\
<|header_start|>assistant<|header_end|>

[{% for tc in message.tool_calls %}{{ tc.function.name }}(\
{% for key, value in tc.function.arguments | items %}{{ key }}={{ value | tojson }}\
{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}\
{% endfor %}]<|eot|>
{%- elif message.role == 'tool' %}<|header_start|>ipython<|header_end|>

{{ message.content }}<|eot|>
{%- else %}<|header_start|>{{ message.role }}<|header_end|>

{{ message.content }}<|eot|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|header_start|>assistant<|header_end|>

{% endif %}"""

#: (with gpt-oss's line naming the reasoning effort, so a test sees the variable arrive)
GPT_OSS = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for t in tools %}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'system' %}<|start|>developer<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' and m.tool_calls %}{% for tc in m.tool_calls %}\
<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json<|message|>\
{{ tc.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}\
<|end|>
{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary\
<|message|>{{ m.content }}<|end|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

DEEPSEEK_R1 = """{{- bos_token }}{% if reasoning_effort is defined %}Reasoning: \
{{ reasoning_effort }}
{% endif %}{% for message in messages %}
{%- if message.role == 'system' %}{{ message.content }}
{%- elif message.role == 'user' %}<｜User｜>{{ message.content }}
{%- elif message.role == 'assistant' %}<｜Assistant｜>{% set c = message.content %}
{%- if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}{{ c }}\
<｜end▁of▁sentence｜>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<｜Assistant｜><think>
{% endif %}"""


@dataclasses.dataclass(frozen=True)
class Family:
    template: str
    #: special tokens (left out of text unless asked), the first the BOS when ``bos``
    specials: tuple[str, ...]
    #: added tokens that are not special (text like any other)
    added: tuple[str, ...]
    eos: str
    #: the tokens the generation prompt starts from, and the text after them in it
    anchors: tuple[str, ...]
    after_anchor: str
    bos: str | None = None
    #: more tokens that end a sequence (generation_config's eos_token_id list)
    stops: tuple[str, ...] = ()
    #: the token a tool's result opens with in the prompt
    tool_marker: str | None = None


_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_ADDED = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

FAMILIES: dict[str, Family] = {
    "qwen2_5": Family(
        QWEN.replace("{# THINK #}", ""), _QWEN_SPECIALS, _QWEN_ADDED,
        "<|im_end|>", ("<|im_start|>",), "assistant\n", tool_marker="<tool_response>",
    ),
    "qwen3": Family(
        QWEN.replace("{# THINK #}", QWEN3_THINK), _QWEN_SPECIALS, _QWEN_ADDED,
        "<|im_end|>", ("<|im_start|>",), "assistant\n",
    ),
    "qwen3_coder": Family(
        QWEN3_CODER, _QWEN_SPECIALS, _QWEN_ADDED, "<|im_end|>", ("<|im_start|>",),
        "assistant\n",
    ),
    "llama3": Family(
        LLAMA3,
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>"),
        (), "<|eot_id|>", ("<|end_header_id|>",), "\n\n", bos="<|begin_of_text|>",
    ),
    "mistral": Family(
        MISTRAL,
        ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
         "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
        (), "</s>", ("[/INST]", "[/TOOL_RESULTS]"), "", bos="<s>",
    ),
    "llama4": Family(
        LLAMA4,
        ("<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>",
         "<|python_start|>", "<|python_end|>"),
        (), "<|eot|>", ("<|header_end|>",), "\n\n", bos="<|begin_of_text|>",
    ),
    "gpt_oss": Family(
        GPT_OSS,
        ("<|startoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>",
         "<|constrain|>", "<|call|>", "<|return|>"),
        (), "<|return|>", ("<|start|>",), "assistant", stops=("<|call|>",),
    ),
    "deepseek_r1": Family(
        DEEPSEEK_R1,
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        ("<think>", "</think>"), "<｜end▁of▁sentence｜>", ("<｜Assistant｜>",), "<think>\n",
        bos="<｜begin▁of▁sentence｜>",
    ),
}  # fmt: skip

#: text the tokenizer also learns from, so everyday words are whole tokens
CORPUS = (
    "What is the weather in Paris today? The weather in Paris is sunny. Please call the tool. "
    "I will check the weather for you. Let me look that up. The user asks about the city. "
    'get_weather city Paris unit celsius days get_time zone Europe {"name": "arguments": '
)


def tokenizer(family: Family, scripts: list[str]):
    """The family's trained ``tokenizers.Tokenizer`` (deterministic for the same texts)."""
    import llm_bpe
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words: Counter[str] = llm_bpe.count_words(
        [CORPUS, family.template, *scripts] * 3, pre.pre_tokenize_str
    )
    tokens, merges = llm_bpe.train(words, 900, initial=pre_tokenizers.ByteLevel.alphabet())
    made = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    made.pre_tokenizer = pre
    made.decoder = decoders.ByteLevel()
    made.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in family.specials]
    )
    made.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    return made


def _graph(vocab: int, anchors: list[int], scripts: list[list[int]], after: int, tool: int | None):
    """``scripts[1]`` (if any) answers a prompt holding the ``tool`` token (a tool's result),
    ``scripts[0]`` any other."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    flags = np.zeros(vocab, np.float32)
    flags[anchors] = 1.0
    if tool is not None:
        flags[tool] = -1.0  # cached as -1: the prompt's minimum says a result is in it
    first, second = scripts[0], scripts[-1]
    rows = [*first, *second] if len(scripts) > 1 else first
    table = np.full((len(rows), vocab), -1e4, np.float32)
    table[np.arange(len(rows)), rows] = 0.0
    nodes = [
        # where the token is an anchor of the prompt (a step of several tokens: the prefill,
        # never a generated token's step): position + 1, cached as every position's key
        helper.make_node("Gather", ["flags", "input_ids"], ["flag"]),
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Gather", ["ids_shape", "one_i"], ["seq"]),
        helper.make_node("Cast", ["seq"], ["seq_f"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["seq_f", "one"], ["more"]),
        helper.make_node("Clip", ["more", "zero", "one"], ["prefill"]),
        helper.make_node("Mul", ["flag", "prefill"], ["prompt_flag"]),
        helper.make_node("Cast", ["position_ids"], ["pos"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["pos", "one"], ["pos1"]),
        helper.make_node("Relu", ["prompt_flag"], ["anchor_flag"]),
        helper.make_node("Sub", ["anchor_flag", "prompt_flag"], ["tool_flag"]),
        helper.make_node("Mul", ["anchor_flag", "pos1"], ["anchor_mark"]),
        helper.make_node("Sub", ["anchor_mark", "tool_flag"], ["mark"]),
        helper.make_node("Unsqueeze", ["mark", "axes13"], ["mark4"]),
        helper.make_node("Mul", ["mark4", "ones_head"], ["new"]),
        helper.make_node("Concat", ["past_key_values.0.key", "new"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "new"], ["present.0.value"], axis=2),
        # the last anchor's position + 1, then the script's step at each position
        helper.make_node("ReduceMax", ["present.0.key"], ["last"], axes=[1, 2, 3], keepdims=0),
        helper.make_node("Unsqueeze", ["last", "axes1"], ["last2"]),
        helper.make_node("Sub", ["pos1", "last2"], ["since"]),
        helper.make_node("Sub", ["since", "after"], ["step"]),
        # which script: 1 when a tool's result is in the prompt (the cache's minimum is -1)
        helper.make_node("ReduceMin", ["present.0.key"], ["low"], axes=[1, 2, 3], keepdims=0),
        helper.make_node("Neg", ["low"], ["which1"]),
        helper.make_node("Unsqueeze", ["which1", "axes1"], ["which"]),
        helper.make_node("Mul", ["which", "grow"], ["more_end"]),
        helper.make_node("Add", ["end", "more_end"], ["last_step"]),
        helper.make_node("Max", ["step", "zero"], ["from0"]),
        helper.make_node("Min", ["from0", "last_step"], ["clipped"]),
        helper.make_node("Mul", ["which", "offset"], ["base"]),
        helper.make_node("Add", ["clipped", "base"], ["row"]),
        helper.make_node("Cast", ["row"], ["index"], to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "index"], ["logits"]),
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
    ]
    graph = helper.make_graph(
        nodes,
        "scripted-decoder",
        *optimum_interface(vocab, ["mask_shape"]),
        [
            numpy_helper.from_array(flags, "flags"),
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array(1.0, np.float32), "one"),
            numpy_helper.from_array(np.array(1, np.int64), "one_i"),
            numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
            numpy_helper.from_array(np.array(float(after), np.float32), "after"),
            numpy_helper.from_array(np.array(float(len(first) - 1), np.float32), "end"),
            numpy_helper.from_array(np.array(float(len(second) - len(first)), np.float32), "grow"),
            numpy_helper.from_array(
                np.array(float(len(first) if len(scripts) > 1 else 0), np.float32), "offset"
            ),
            numpy_helper.from_array(np.ones(HEAD, np.float32), "ones_head"),
            numpy_helper.from_array(np.array([1, 3], np.int64), "axes13"),
            numpy_helper.from_array(np.array([1], np.int64), "axes1"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def write(
    folder: Path,
    family: str,
    script: str,
    context: int = 4096,
    end: str | None = None,
    after_tool: str | None = None,
) -> Path:
    """The folder at ``folder`` (made): ``family``'s template and tokens, answering ``script``
    then ``end`` (the family's end of sequence unless given: one of its stops) to every chat,
    or ``after_tool`` (then the end of sequence) to a chat holding a tool's result (the
    family's ``tool_marker``), so an agent's turn runs: the call, then the answer."""
    import onnx

    spec = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    made = tokenizer(spec, [script, *([after_tool] if after_tool else [])])
    made.save(str(folder / "tokenizer.json"))
    config = {
        "eos_token": spec.eos,
        "bos_token": spec.bos,
        "chat_template": spec.template,
        "add_bos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    eos = made.token_to_id(spec.eos)
    stops = [eos, *(made.token_to_id(t) for t in spec.stops)]
    ids = [*made.encode(script, add_special_tokens=False).ids, made.token_to_id(end or spec.eos)]
    scripts = [ids]
    if after_tool is not None:
        scripts.append([*made.encode(after_tool, add_special_tokens=False).ids, eos])
    tool = made.token_to_id(spec.tool_marker) if after_tool and spec.tool_marker else None
    after = len(made.encode(spec.after_anchor, add_special_tokens=False).ids)
    anchors = [made.token_to_id(a) for a in spec.anchors]
    vocab = made.get_vocab_size(with_added_tokens=True)
    onnx.save(_graph(vocab, anchors, scripts, after, tool), str(folder / "model.onnx"))
    model = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": context,
        "hidden_size": HEAD,
        "head_dim": HEAD,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "eos_token_id": eos,
    }
    (folder / "config.json").write_text(json.dumps(model))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return folder
