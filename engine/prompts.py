"""Benchmark prompts: the built-in defaults and the JSONL prompt-file format.

A prompt file has one JSON object per line: {"prompt": "..."} (raw text, tokenised as is) or
{"messages": [...]} (chat messages, run through the tokenizer's chat template). Other keys (a data set's
ids, answers, ...) are ignored.
"""

import json
import lzma
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class Prompt(BaseModel):
    """One benchmark prompt: raw text or chat messages, exactly one of the two."""

    model_config = ConfigDict(extra="ignore")
    prompt: str | None = None
    messages: list[Message] | None = None

    @model_validator(mode="after")
    def one_kind(self):
        if self.prompt is None and self.messages is None:
            raise ValueError('no "prompt" (text) or "messages" (chat) in it')
        if self.prompt is not None and self.messages is not None:
            raise ValueError('give one of "prompt" or "messages", not both')
        if self.prompt == "" or self.messages == []:
            raise ValueError("the prompt is empty")
        return self

    def token_ids(self, tokenizer) -> list[int]:
        if self.prompt is not None:
            return tokenizer(self.prompt, add_special_tokens=False).input_ids
        messages = [m.model_dump() for m in self.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids


def chat(text: str) -> Prompt:
    return Prompt(messages=[Message(role="user", content=text)])


DEFAULT_PROMPTS = [
    chat("Write a Python function that returns the n-th Fibonacci number iteratively."),
    chat("If a train travels 120 km in 1.5 hours, what is its average speed in km/h? Explain step by step."),
    chat("What are three good ways to stay focused while working from home?"),
    chat(
        "Summarise in two sentences: The city council met on Tuesday to discuss the new bike lanes. "
        "Supporters said the lanes would reduce traffic and pollution, while shop owners worried about "
        "losing parking spaces. The council voted 5 to 2 to build the lanes next spring."
    ),
    chat("Write a SQL query that lists the ten customers with the highest total order value."),
    chat("Solve for x: 3x + 7 = 22. Show your work."),
    chat("Tell me a short story about a robot who learns to paint."),
    chat("Explain the difference between a list and a tuple in Python."),
]


class PromptFileError(ValueError):
    pass


def reason(e: json.JSONDecodeError | ValidationError) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"invalid JSON: {e.msg}"
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def write_prompts(path, prompts: list[Prompt]):
    """A JSONL prompt file that read_prompts reads back (.xz: compressed with xz)."""
    text = "".join(p.model_dump_json(exclude_none=True) + "\n" for p in prompts).encode()
    Path(path).write_bytes(lzma.compress(text) if Path(path).suffix == ".xz" else text)


def read_prompts(path) -> list[Prompt]:
    """Parse a JSONL prompt file (.jsonl.xz: compressed with xz); errors name the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: no such file")
    data = path.read_bytes()
    prompts = []
    for number, line in enumerate((lzma.decompress(data) if path.suffix == ".xz" else data).decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(Prompt.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError) as e:
            raise PromptFileError(f"{path}:{number}: {reason(e)}") from None
    if not prompts:
        raise PromptFileError(f"{path}: no prompts in the file")
    return prompts
