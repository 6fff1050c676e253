"""A tiny model scripted to call a tool: its chat template renders tools, and its
tokenizer spells the greedy reply's first three tokens as `<tool_call>`, a call and
`</tool_call>` (the hermes format), so tool calling is tested end to end on a model
that runs in a second."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sparsevllm import LLM, SamplingParams

TOOL_TEMPLATE = (
    "{% if tools %}<s> system : {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "</s> {% endif %}"
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "w77",
            "description": "the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL_WORD = '{"name":"w77","arguments":{"city":"Paris"}}'
ASK = [{"role": "user", "content": "w5 w6 w7"}]


def scripted_tool_model(tiny_path: str, where: Path) -> str:
    """A copy of the tiny model under `where` with a template that renders tools, and a
    tokenizer whose words for the greedy reply's first three tokens are "<tool_call>", a
    call and "</tool_call>"."""
    path = where / "model"
    shutil.copytree(tiny_path, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_file.write_text(json.dumps(config))
    for extra in path.glob("chat_template.*"):
        extra.unlink()
    llm = LLM(str(path), max_model_len=512, enable_prefix_caching=False)
    ids = llm.tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reply = llm.generate([ids], params, use_tqdm=False)[0].token_ids
    llm.close()
    assert len(set(reply[:3])) == 3, "the scripted reply needs three distinct tokens"
    spec = json.loads((path / "tokenizer.json").read_text())
    words = {i: w for w, i in spec["model"]["vocab"].items()}
    renamed = dict(zip((words[t] for t in reply[:3]), ("<tool_call>", CALL_WORD, "</tool_call>")))
    spec["model"]["vocab"] = {renamed.get(w, w): i for w, i in spec["model"]["vocab"].items()}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return str(path)
