"""The check every chat template gets before it renders data or a prompt:
without datasets, so that `generate` stays light."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jinja2 import TemplateSyntaxError

from finetune.errors import UsageError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROBE = [{"role": "user", "content": "probe question 7"}, {"role": "assistant", "content": "probe answer 7"}]


def check_chat_template(tokenizer: PreTrainedTokenizerBase, what: str) -> None:
    """A template renders a plain exchange, with its content, before any
    example is blamed for it. Template code can raise anything (a syntax error,
    `{{ 1/0 }}`, str + int): every failure is this file's, said in one line."""
    try:
        rendered = tokenizer.apply_chat_template(PROBE, tokenize=False)
    except TemplateSyntaxError as e:
        raise UsageError(f"{what}: line {e.lineno}: {e.message}; fix the template's Jinja syntax") from None
    except Exception as e:  # noqa: BLE001  (user code: any exception is the template's)
        raise UsageError(f"{what} fails to render a conversation ({type(e).__name__}: {str(e)[:120]}); fix the "
                         "template") from None
    if not isinstance(rendered, str) or PROBE[1]["content"] not in rendered.lower():  # some templates change case
        raise UsageError(f"{what} does not write the messages' content (it rendered {str(rendered)[:60]!r}); pass "
                         "a Jinja chat template that renders each message's content")
