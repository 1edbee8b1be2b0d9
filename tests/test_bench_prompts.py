"""The RAG and agent prompt files for `dflash-serve bench` (data/prompts/rag.jsonl, agent.jsonl) are what
the load test's scenario builder makes, so the one-process bench measures the traffic the server sees."""

import json
from pathlib import Path

from engine.prompts import read_prompts

ROOT = Path(__file__).resolve().parent.parent


def test_committed_bench_prompts_are_the_scenarios_own(tmp_path):
    """Everything but the agent's first reply is the builder's; that reply is the model's own (greedy, as the
    load test's users keep it in the history), made once with greedy_reply and committed."""
    from loadtest.scenarios import write_bench_prompts

    committed = {name: [json.loads(line) for line in (ROOT / "data/prompts" / name).read_text().splitlines()]
                 for name in ("rag.jsonl", "agent.jsonl")}
    replies = iter([p["messages"][2]["content"] for p in committed["agent.jsonl"]])
    for path in write_bench_prompts(tmp_path, lambda messages: next(replies)):
        built = [json.loads(line) for line in path.read_text().splitlines()]
        assert built == committed[path.name], f"data/prompts/{path.name} is stale: rebuild it with write_bench_prompts"
    agent = read_prompts(ROOT / "data/prompts/agent.jsonl")
    assert len(agent) == 16 and all([m.role for m in p.messages] == ["system", "user", "assistant", "tool"] for p in agent)
    assert all(p.messages[2].content.strip() for p in agent)
    rag = read_prompts(ROOT / "data/prompts/rag.jsonl")
    assert len(rag) == 16 and all("Question:" in p.messages[0].content for p in rag)
