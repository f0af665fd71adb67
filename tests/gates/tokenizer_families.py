"""The tokenizer zoo's families for the gate tests: trained once per session, used locally or as model directories."""

from __future__ import annotations

from functools import cache

from kvpolicy_dev.sim.tokenizer_zoo import Family, build
from tokenizers import Tokenizer

FAMILIES = tuple(Family)


@cache
def trained(family: Family) -> Tokenizer:
    return build(family)


class LocalTokenizer:
    """A family's tokenizer answering as a server's /tokenize would, without a server."""

    def __init__(self, family: Family) -> None:
        self.base_url = f"local {family.value}"
        self.tokenizer = trained(family)

    async def tokenize(self, prompt: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, tokens: list[int]) -> str:
        text: str = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return text
