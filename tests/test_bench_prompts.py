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


def test_traffic_training_prompts_ask_nothing_the_bench_or_the_load_test_asks():
    """The drafter's RAG and agent training requests (data/prompts/traffic-train.jsonl.xz) are the builder's,
    of the bench's kind, and share no question and no tool call with the bench prompts or the load test's
    traffic: those still measure requests the drafter never saw."""
    import random

    from loadtest.scenarios import Retriever, agent_tasks, rag_items, stdlib_passages, training_prompts, traffic

    committed = read_prompts(ROOT / "data/prompts/traffic-train.jsonl.xz")
    replies = iter([p.messages[2].content for p in committed if len(p.messages) == 4])
    built = training_prompts(len(committed) // 2, lambda conversations: [next(replies) for _ in conversations])
    assert [p.model_dump() for p in built] == [p.model_dump() for p in committed], \
        "data/prompts/traffic-train.jsonl.xz is stale: rebuild it with dflash-serve datagen --write-traffic-prompts"
    rag = [p for p in committed if len(p.messages) == 1]
    agent = [p for p in committed if len(p.messages) == 4]
    assert len(rag) == len(agent) >= 100
    assert all([m.role for m in p.messages] == ["system", "user", "assistant", "tool"] for p in agent)

    retriever = Retriever(stdlib_passages())
    load_test = traffic(retriever, 120, 0)
    seen_rag = load_test["rag"] + rag_items(retriever, 16, random.Random(0))
    seen_agent = load_test["agent"]["tasks"] + agent_tasks(retriever, 16, random.Random(0))
    questions = {r["prompt"] for r in seen_rag}
    assert not questions & {p.messages[0].content for p in rag}
    asked = {(t["task"], t["observation"]) for t in seen_agent}
    assert not asked & {(p.messages[1].content, p.messages[3].content) for p in agent}
    bench = {p.messages[0].content for p in read_prompts(ROOT / "data/prompts/rag.jsonl")}
    assert bench <= questions  # the bench's RAG requests are among those excluded
