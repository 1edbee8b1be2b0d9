"""The RAG and agent prompt files for `dflash-serve bench` (data/prompts/rag.jsonl, agent.jsonl) are what
the load test's scenario builder makes, so the one-process bench measures the traffic the server sees."""

from pathlib import Path

from engine.prompts import read_prompts

ROOT = Path(__file__).resolve().parent.parent


def test_committed_bench_prompts_are_the_scenarios_own(tmp_path):
    from loadtest.scenarios import write_bench_prompts

    for path in write_bench_prompts(tmp_path):
        committed = ROOT / "data" / "prompts" / path.name
        assert path.read_text() == committed.read_text(), f"{committed} is stale: rebuild it with write_bench_prompts"
    agent = read_prompts(ROOT / "data/prompts/agent.jsonl")
    assert len(agent) == 16 and all([m.role for m in p.messages] == ["system", "user", "assistant", "tool"] for p in agent)
    rag = read_prompts(ROOT / "data/prompts/rag.jsonl")
    assert len(rag) == 16 and all("Question:" in p.messages[0].content for p in rag)
