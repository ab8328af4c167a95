"""Chat rendering for episodes: the prompt tokenised once, each environment answer as the template's delta.

The sequence an episode trains on is::

    prompt ids | turn 1 as sampled | env answer 1 | turn 2 as sampled | env answer 2 | ...

The prompt is ``render(messages, tools, add_generation_prompt=True)`` tokenised once. A policy
turn is the token ids the backend sampled, never re-encoded. An environment answer is the text the
chat template puts after that conversation, tokenised once: ``render(conversation + answer,
add_generation_prompt=True)`` minus ``render(conversation)``, where the conversation ends with the
policy's turn, preceded by whatever the template renders after an assistant message that the
policy did not sample itself (Qwen's ``\\n`` after ``<|im_end|>``; the whole ``<|im_end|>\\n`` when
the turn ended on a stop string such as ``</tool_call>``).

This is sound only for a prefix-preserving template: rendering a conversation plus new messages
starts with the rendering of the conversation, and an assistant message renders as its content
followed by a fixed suffix. Qwen3's template is not (it drops the ``<think>`` blocks of earlier
turns). ``check_prefix_preserving`` tries a probe conversation once, before training, with the
roles the run uses (tools and tool messages only with tools, a system message only with
``data.system_prompt``), and refuses such a template in one line naming ``data.chat_template``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ppo_lightning.envs.base import Message
from ppo_lightning.config.errors import ConfigError

log = logging.getLogger(__name__)

_PROBE_CALL = '<tool_call>{"name": "probe", "arguments": {"x": 1}}</tool_call>'
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A probe tool.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "x"}}},
    },
}


def probe_conversation(tools: bool, system: bool) -> list[Message]:
    """A conversation with every kind of turn a run's episodes make, and no other (a template
    that cannot render a role the run never uses is not refused for it): a system message where
    the run has one (``data.system_prompt``), a tool call with a reasoning block and its result
    where the environment has tools, an answer, a user's follow-up and a last answer. The check
    renders each prefix of it."""
    first = "<think>probe thought</think>probe reply"
    turns: list[Message] = [{"role": "system", "content": "probe system"}] if system else []
    turns.append({"role": "user", "content": "probe question"})
    if tools:
        turns += [
            {"role": "assistant", "content": first + " " + _PROBE_CALL},
            {"role": "tool", "name": "probe", "content": "probe result"},
            {"role": "assistant", "content": "probe answer"},
        ]
    else:
        turns.append({"role": "assistant", "content": first})
    turns += [{"role": "user", "content": "probe follow-up"}, {"role": "assistant", "content": "probe last"}]
    return turns


class ChatRenderer:
    """Renders conversations with one chat template (``data.chat_template``, else the tokenizer's)
    and the episode's tool schemas, and tokenises what it renders with ``tokenizer``."""

    def __init__(self, tokenizer, chat_template: str | None = None, source: str = "the tokenizer's chat template"):
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        self.source = source if chat_template is None else "data.chat_template"
        if not self.template:
            raise ConfigError(
                "env: episodes are chat conversations, but the tokenizer has no chat template; set "
                "data.chat_template (a Jinja string or a file)"
            )
        self.eos_text = tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id)
        self.assistant_suffix = ""  # what the template writes after an assistant message's content
        self.probe: list[Message] = probe_conversation(tools=True, system=False)  # check_prefix_preserving's
        self.probe_tools: list[dict] | None = [PROBE_TOOL]
        self.fallbacks = 0  # observation_ids calls whose conversation was not prefix-preserving

    def render(self, messages: list[Message], tools: list[dict] | None = None, add_generation_prompt=False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def turn_text(self, tokens: list[int], stops=None) -> tuple[str, str]:
        """``(content, ended_with)`` of a policy turn's sampled ``tokens``: the assistant message's
        content, and the text of its final stop that the template's assistant suffix starts with
        (the policy sampled that much of the suffix; ``observation_ids`` adds the rest). ``stops``
        (a ``StopChecker``, given when the turn stopped): EOS is never content; a stop token or
        stop string whose text starts the suffix (``<|im_end|>`` where EOS is ``<|endoftext|>``,
        Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``) is treated as EOS is, so it is
        neither in the content the environment and the reward read nor written twice in the
        sequence. Any other stop (``</tool_call>``) stays in the content."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        suffix = self.assistant_suffix
        if stops is not None and tokens and tokens[-1] in stops.ids:
            last = self.eos_text if tokens[-1] == self.tokenizer.eos_token_id else decode(tokens[-1:])
            if tokens[-1] == self.tokenizer.eos_token_id or (last and suffix.startswith(last)):
                return decode(tokens[:-1]), last if suffix.startswith(last) else ""
        text = decode(tokens)
        for stop in stops.strings if stops is not None else ():
            i = text.rfind(stop)  # the stop's token may carry text after it (a BPE ">\n")
            if i >= 0 and suffix.startswith(text[i:]):
                return text[:i], text[i:]
        return text, ""

    def observation_ids(
        self, conversation: list[Message], answer: list[Message], tools: list[dict] | None, ended_with: str = ""
    ) -> list[int]:
        """The tokens of ``answer`` (the environment's messages) after ``conversation``, whose last
        message is the policy's turn: the template's delta, preceded by the part of the assistant
        suffix the policy did not sample (``ended_with``: the text of its final stop that starts
        the suffix, ``turn_text``'s)."""
        before = self.render(conversation, tools)
        after = self.render(conversation + answer, tools, add_generation_prompt=True)
        if not after.startswith(before):  # the probe passed, this conversation does not
            after, before = self._delta_after_probe(answer)
        tail = self.assistant_suffix
        if ended_with and tail.startswith(ended_with):
            tail = tail[len(ended_with) :]
        return self.encode(tail + after[len(before) :])

    def _delta_after_probe(self, answer: list[Message]) -> tuple[str, str]:
        """``(after, before)`` for ``answer`` rendered after the probe's first assistant turn: the
        answer's own tokens when the episode's conversation is one the template re-renders (the
        sequence keeps the tokens already sampled either way). Counted in ``fallbacks``
        (``env/template_fallbacks``) and warned about once."""
        if not self.fallbacks:
            log.warning(
                "%s re-rendered an episode's earlier messages when the environment's answer was added; its "
                "answer is tokenised as the template renders it after a probe conversation "
                "(env/template_fallbacks counts these)",
                self.source,
            )
        self.fallbacks += 1
        head = self.probe[: next(i for i, m in enumerate(self.probe) if m["role"] == "assistant") + 1]
        after = self.render(head + answer, self.probe_tools, add_generation_prompt=True)
        return after, self.render(head, self.probe_tools)

    def check_prefix_preserving(self, name: str, tools: bool = True, system: bool = False) -> None:
        """Render every prefix of the probe conversation (``probe_conversation(tools, system)``:
        the turns the run's episodes make, with a tool schema where there are tools) and check
        that each rendering continues the one before it, and that an assistant message is its
        content followed by a fixed suffix. Sets ``assistant_suffix``; refuses a template that
        fails in one line naming it (``name``: the tokenizer's path) and ``data.chat_template``."""
        conv = self.probe = probe_conversation(tools, system)
        tools_arg = self.probe_tools = [PROBE_TOOL] if tools else None
        roles = ", ".join(dict.fromkeys(m["role"] for m in conv))
        suffixes = set()

        def continues(before: str, after: str, what: str) -> None:
            if not after.startswith(before):
                raise _NotPrefix(what)

        try:
            for k in range(1, len(conv) + 1):
                message, before = conv[k - 1], self.render(conv[: k - 1], tools_arg) if k > 1 else ""
                full = self.render(conv[:k], tools_arg)
                if message["role"] == "assistant":  # the generation prompt, then the content, then a suffix
                    prompt = self.render(conv[: k - 1], tools_arg, add_generation_prompt=True)
                    continues(before, prompt, f"the generation prompt re-renders the messages before message {k - 1}")
                    continues(prompt, full, f"assistant message {k - 1} re-renders the messages before it")
                    rest = full[len(prompt) :]
                    if not rest.startswith(message["content"]):
                        raise _NotPrefix(f"assistant message {k - 1} does not render as its content")
                    suffixes.add(rest[len(message["content"]) :])
                else:  # an environment's answer (or the prompt) appended, with and without the next turn's prompt
                    continues(before, full, f"adding message {k - 1} ({message['role']}) re-renders the ones before it")
                    gen = self.render(conv[:k], tools_arg, add_generation_prompt=True)
                    continues(before, gen, f"adding message {k - 1} ({message['role']}) re-renders the ones before it")
        except _NotPrefix as e:
            raise ConfigError(
                f"{self.source} of {name} is not prefix-preserving ({e}), so the environment's tokens cannot be "
                "appended to the sampled ones; set data.chat_template to a template that renders earlier messages "
                "unchanged"
            ) from None
        except Exception as e:  # the template rejects a role (tool, system) or the tools argument
            raise ConfigError(
                f"{self.source} of {name} cannot render a conversation with the roles {roles}"
                f"{' and tools' if tools else ''} ({type(e).__name__}: {e}); set data.chat_template to one that "
                "renders them"
            ) from None
        if len(suffixes) != 1:
            raise ConfigError(
                f"{self.source} of {name} ends assistant messages differently ({sorted(suffixes)}); set "
                "data.chat_template to one that ends every assistant message alike"
            )
        self.assistant_suffix = suffixes.pop()

    def check_renders_tools(self, name: str, tools: list[dict]) -> None:
        """The template shows ``tools`` to the model: rendering with them differs from without."""
        messages = [{"role": "user", "content": "probe question"}]
        try:
            with_tools = self.render(messages, tools, add_generation_prompt=True)
        except Exception as e:
            with_tools, err = None, e
        if with_tools is None or with_tools == self.render(messages, None, add_generation_prompt=True):
            why = f" ({type(err).__name__}: {err})" if with_tools is None else ""
            raise ConfigError(
                f"{self.source} of {name} cannot render tools{why}, so the model would never see them; set "
                "data.chat_template to a template that renders the tools argument"
            )


class _NotPrefix(Exception):
    pass


def conversation_text(messages: list[Message]) -> str:
    """A conversation as one readable string, each message under its role (samples tables, logs)."""
    return "\n".join(f"[{m['role']}{'/' + m['name'] if m.get('name') else ''}] {m['content']}" for m in messages)


def jsonable(x: Any) -> Any:
    """``x`` with anything JSON cannot hold turned into its string (record columns in dumps)."""
    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        if isinstance(x, dict):
            return {str(k): jsonable(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [jsonable(v) for v in x]
        return str(x)
