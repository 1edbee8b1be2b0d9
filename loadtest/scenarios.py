"""The load tests' traffic, built ahead of a run so the load generator only replays it.

- chat: real multi-turn ShareGPT conversations (the human turns; the assistant turns are the
  server's own replies at run time). Only conversations of the held-out split (engine/datagen.py),
  which the shipped drafter was never trained on.
- rag: a question about Python's standard library plus the passages BM25 retrieves for it from a
  corpus made of the standard library's own docstrings (modules, classes, functions).
- agent: a system prompt with tools as JSON schemas, a task, the tool call the task needs and the
  tool's real result (BM25 search over the same corpus, arithmetic, http.HTTPStatus). The user asks
  for a JSON tool call, sends the observation back and asks for a JSON answer.

`build(path)` writes everything as one JSON file that loadtest/locustfile.py reads; `cached_file()` is
that file in the cache directory, built on first use.
"""

import ast
import fcntl
import hashlib
import json
import random
import re
from http import HTTPStatus
from pathlib import Path

from engine.datagen import PromptItem, sharegpt_conversations, stdlib_modules, summary_line
from engine.default_model import cache_dir
from engine.prompts import Message, Prompt, write_prompts

SEED = 0
MAX_TURN_CHARS = 600  # a human turn is cut to this (the server's context is 2,048 tokens)
MAX_TURNS = 3  # human turns replayed per conversation
PASSAGE_CHARS = 600
RAG_PASSAGES = 4


# ---- chat ---------------------------------------------------------------------------------------


def chat_conversations(limit: int = 200) -> list[list[str]]:
    """Held-out ShareGPT conversations with at least two human turns, as lists of human turns."""
    out = []
    for c in sharegpt_conversations():
        if not PromptItem(f"sharegpt/{c['id']}", "sharegpt", "").held_out:
            continue
        turns = [t.get("value", "").strip() for t in c.get("conversations") or [] if t.get("from") == "human"]
        turns = [t[:MAX_TURN_CHARS] for t in turns if t][:MAX_TURNS]
        if len(turns) >= 2:
            out.append(turns)
    return out[:limit]


# ---- the corpus and BM25 ------------------------------------------------------------------------


def stdlib_passages() -> list[dict]:
    """Passages {"title", "kind", "summary", "text"}: each documented public module, class and function of the stdlib."""
    passages = []
    for module, tree in stdlib_modules():
        if module.startswith("_"):
            continue
        doc = ast.get_docstring(tree)
        if doc:
            passages.append({"title": module, "kind": "module", "summary": summary_line(doc),
                             "text": " ".join(doc.split())[:PASSAGE_CHARS]})
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc:
                    signature = f"({ast.unparse(node.args)})" if isinstance(node, ast.FunctionDef) else ""
                    text = f"{module}.{node.name}{signature}: {' '.join(doc.split())}"
                    passages.append({"title": f"{module}.{node.name}", "summary": summary_line(doc),
                                     "kind": "function" if signature else "class", "text": text[:PASSAGE_CHARS]})
    return passages


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class Retriever:
    """BM25 (Okapi, rank_bm25) over the passages' words."""

    def __init__(self, passages: list[dict]):
        from rank_bm25 import BM25Okapi

        self.passages = passages
        self.bm25 = BM25Okapi([words(p["text"]) for p in passages])

    def search(self, query: str, k: int) -> list[dict]:
        scores = self.bm25.get_scores(words(query))
        best = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
        return [self.passages[i] for i in best]


def rag_items(retriever: Retriever, n: int, rng: random.Random) -> list[dict]:
    """{"question", "passages": [titles], "prompt"}: questions about documented functions, two kinds:
    by name ("what does json.dumps do") and by purpose (the docstring's summary, no name)."""
    functions = [p for p in retriever.passages if p["kind"] == "function"]
    items = []
    for i, p in enumerate(rng.sample(functions, n)):
        if i % 2 == 0:
            question = f"What does `{p['title']}` do, and how do I call it? Give a short example."
        else:
            purpose = p["summary"].split(". ")[0].rstrip(".")
            question = f"Which Python standard library function should I use to do this: {purpose}?"
        found = retriever.search(question, RAG_PASSAGES)
        context = "\n\n".join(f"[{j + 1}] {q['text']}" for j, q in enumerate(found))
        prompt = (f"Answer the question using the documentation excerpts below.\n\n{context}\n\n"
                  f"Question: {question}")
        items.append({"question": question, "passages": [q["title"] for q in found], "prompt": prompt})
    return items


# ---- agent --------------------------------------------------------------------------------------

TOOLS = [
    {"name": "search_python_docs", "description": "Search the Python standard library documentation.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                    "required": ["query"]}},
    {"name": "calculator", "description": "Evaluate an arithmetic expression with + - * / ** and parentheses.",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
    {"name": "http_status", "description": "The standard phrase and description of an HTTP status code.",
     "parameters": {"type": "object", "properties": {"code": {"type": "integer"}}, "required": ["code"]}},
]

AGENT_SYSTEM = (
    "You are an assistant that can call tools. The tools, as JSON schemas:\n" + json.dumps(TOOLS, indent=1) +
    '\nTo call a tool, reply with only a JSON object {"tool": <name>, "arguments": {...}}. After a tool '
    'result, reply with only a JSON object {"answer": <string>}.')


def calculate(expression: str):
    """Arithmetic only (numbers, + - * / ** and parentheses), by walking the parsed expression."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a ** b}

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return ev(ast.parse(expression, mode="eval").body)


def agent_tasks(retriever: Retriever, n: int, rng: random.Random) -> list[dict]:
    """{"task", "call": {"tool", "arguments"}, "observation"}: the tool call the task needs and its
    real result (what the load generator sends back whatever the model replied)."""
    statuses = list(HTTPStatus)
    functions = [p for p in retriever.passages if p["kind"] == "function"]
    tasks = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            purpose = rng.choice(functions)["summary"].split(". ")[0].rstrip(".")
            call = {"tool": "search_python_docs", "arguments": {"query": purpose, "k": 3}}
            observation = [{"title": p["title"], "excerpt": p["text"][:160]} for p in retriever.search(purpose, 3)]
            task = f"Find the Python standard library function that does this: {purpose}"
        elif kind == 1:
            a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(1, 9999)
            expression = f"{a} * {b} + {c}"
            call = {"tool": "calculator", "arguments": {"expression": expression}}
            observation = {"result": calculate(expression)}
            task = f"What is {a} times {b}, plus {c}?"
        else:
            status = rng.choice(statuses)
            call = {"tool": "http_status", "arguments": {"code": int(status)}}
            observation = {"code": int(status), "phrase": status.phrase, "description": status.description}
            task = f"My server answered HTTP {int(status)}. What does that mean, and what should the client do?"
        tasks.append({"task": task, "call": call, "observation": json.dumps(observation)})
    return tasks


# ---- all of it ----------------------------------------------------------------------------------


def conversations(scenario: str, n: int) -> list[list[list[Message]]]:
    """n conversations as the load test's users hold them (one-process experiments): each a list of
    turns, a turn the messages its request adds to the history. Between two turns goes the reply to
    the first (the caller's own, as the server's at run time). chat: the human turns; rag: one
    question; agent: the system prompt and task, then the tool's observation."""
    if scenario == "chat":
        return [[[Message(role="user", content=t)] for t in c] for c in chat_conversations()[:n]]
    retriever, rng = Retriever(stdlib_passages()), random.Random(SEED)
    if scenario == "rag":
        return [[[Message(role="user", content=r["prompt"])]] for r in rag_items(retriever, n, rng)]
    system = Message(role="system", content=AGENT_SYSTEM)
    return [[[system, Message(role="user", content=t["task"])], [Message(role="tool", content=t["observation"])]]
            for t in agent_tasks(retriever, n, rng)]


def first_turns(scenario: str, n: int) -> list[Prompt]:
    """The first request of n conversations (`conversations`) as chat prompts."""
    return [Prompt(messages=c[0]) for c in conversations(scenario, n)]


def bench_prompts(scenario: str, n: int, reply=None) -> list[Prompt]:
    """n requests of a scenario as `dflash-serve bench` runs them (one process, one request each), the
    turn the server decodes most of in the load test: rag, the question with its passages; agent, the
    turn after the tool result, its history holding `reply(messages)`: the model's own answer to the first
    turn, as the load test's users keep it."""
    if scenario == "rag":
        return first_turns("rag", n)
    out = []
    for first, observation in conversations("agent", n):
        answer = Message(role="assistant", content=reply([m.model_dump() for m in first]))
        out.append(Prompt(messages=first + [answer] + observation))
    return out


def write_bench_prompts(folder: Path, reply, n: int = 16) -> list[Path]:
    """data/prompts/rag.jsonl and agent.jsonl: bench_prompts as `bench --prompts` files."""
    paths = []
    for scenario in ("rag", "agent"):
        path = Path(folder) / f"{scenario}.jsonl"
        write_prompts(path, bench_prompts(scenario, n, reply))
        paths.append(path)
    return paths


def greedy_replies(engine, tokenizer, max_tokens: int = 64):
    """replies([messages, ...]) for training_prompts, one batch through the engine: its greedy answers, as the
    load test asks for them. replies([messages])[0] is bench_prompts' reply."""
    from engine.engine import SamplingParams

    def replies(conversations):
        ids = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
               for m in conversations]
        out = engine.generate_batch(ids, SamplingParams(max_tokens=max_tokens))
        return [tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in out]

    return replies


def greedy_reply(engine, tokenizer, max_tokens: int = 64):
    """reply(messages) for bench_prompts: the engine's greedy answer, as the load test asks for it."""
    replies = greedy_replies(engine, tokenizer, max_tokens)
    return lambda messages: replies([messages])[0]


def training_prompts(n: int, replies, seed: int = SEED + 1) -> list[Prompt]:
    """n rag and n agent requests shaped as bench_prompts' (agent: the turn after the tool result, its
    history holding the model's reply from `replies`, batched), drawn with another seed: training data for
    a drafter that serves this traffic. None asks what a bench prompt or the load test asks (the same
    question, the same tool call), so both still measure held-out requests; they share the corpus, the
    tools and the system prompt, as a deployment's requests do."""
    retriever = Retriever(stdlib_passages())
    load_test = traffic(retriever, 120, SEED)
    bench_rag, bench_agent = rag_items(retriever, 16, random.Random(SEED)), agent_tasks(retriever, 16, random.Random(SEED))
    def call(task):
        return json.dumps(task["call"], sort_keys=True)

    asked = {r["question"] for r in load_test["rag"] + bench_rag}
    called = {call(t) for t in load_test["agent"]["tasks"] + bench_agent}
    drawn = traffic(retriever, n + len(asked), seed)  # enough to fill n of each after the exclusions
    rag = [r for r in drawn["rag"] if r["question"] not in asked][:n]
    tasks = [t for t in drawn["agent"]["tasks"] if call(t) not in called][:n]
    system = Message(role="system", content=AGENT_SYSTEM)
    firsts = [[system, Message(role="user", content=t["task"])] for t in tasks]
    answers = replies([[m.model_dump() for m in first] for first in firsts])
    agent = [Prompt(messages=first + [Message(role="assistant", content=a), Message(role="tool", content=t["observation"])])
             for first, a, t in zip(firsts, answers, tasks)]
    return [Prompt(messages=[Message(role="user", content=r["prompt"])]) for r in rag] + agent


def traffic(retriever: Retriever, num_items: int, seed: int) -> dict:
    """The rag and agent items of the load test's traffic (`build`)."""
    rng = random.Random(seed)
    return {"rag": rag_items(retriever, num_items, rng),
            "agent": {"system": AGENT_SYSTEM, "tasks": agent_tasks(retriever, num_items, rng)}}


def build(path: Path, num_items: int = 120, seed: int = SEED) -> dict:
    """Build every scenario's traffic and write it to `path` (JSON); returns it."""
    retriever = Retriever(stdlib_passages())
    data = {"chat": chat_conversations(), **traffic(retriever, num_items, seed), "corpus_passages": len(retriever.passages)}
    Path(path).write_text(json.dumps(data, indent=1))
    return data


def cached_file(seed: int = SEED) -> Path:
    """The traffic `build` makes, in the cache directory: built on first use (one process builds, the
    others wait for it), again when this module changes."""
    version = hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:12]
    path = cache_dir() / "loadtest" / f"scenarios-{version}-seed{seed}.json"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            build(tmp, seed=seed)
            tmp.rename(path)
    return path
