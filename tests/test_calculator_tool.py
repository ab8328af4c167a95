"""The calculator_tool example and recipe: problems a tiny model cannot do in its head, transcripts
whose first turn mostly answers at once, a reward on the final answer, and the job end to end:
tool use learned by RL, the accuracy with and without the tool."""

from __future__ import annotations

import json
import random

import pytest

from ppo_lightning.envs import ChatRenderer, ToolEnvironment
from ppo_lightning.envs.calculator import calculator as calc
from ppo_lightning.recipes.calculator_tool import data as c

TOOLS = ["ppo_lightning.envs.calculator.calculator"]


def test_problems_are_right_and_their_kinds_take_turns():
    records = c.prompt_records(0, 30)
    assert [r["data_source"] for r in records[:3]] == list(c.KINDS)
    for r in records:
        expr = r["prompt"][0]["content"][len("What is ") : -1]
        assert calc(expr) == r["answer"]
    assert len({r["prompt"][0]["content"] for r in records}) == 30


def test_the_tokenizer_decodes_exactly_and_its_template_is_prefix_preserving():
    tok = c.build_tokenizer(c.tokenizer_corpus(0, 300))
    tools = ToolEnvironment(tools=TOOLS).tools
    call = c.tool_call_text("347*26+518")
    ids = tok.encode(call, add_special_tokens=False)
    assert tok.decode(ids) == call and len(ids) < len(call) / 2  # merged boilerplate, exact decoding
    digits = [t for t in tok.convert_ids_to_tokens(tok.encode("347*26", add_special_tokens=False)) if t.isdigit()]
    assert digits == list("34726")  # every digit a token of its own
    r = ChatRenderer(tok)
    r.check_prefix_preserving("calculator")
    r.check_renders_tools("calculator", tools)


def test_sft_turns_teach_the_call_mostly_not_and_the_copy_always():
    tok = c.build_tokenizer(c.tokenizer_corpus(0, 300))
    tools = ToolEnvironment(tools=TOOLS).tools
    records = c.sft_records(random.Random(1), 1000, tok, tools, tool_share=0.3)
    firsts = [r for r in records if r["prompt"].endswith("?\n<|assistant|>")]
    copies = [r for r in records if "<|tool|>" in r["prompt"]]
    assert len(firsts) == len(copies) == 1000
    share = sum(r["response"].startswith(c.TOOL_OPEN) for r in firsts) / 1000
    assert 0.25 < share < 0.35
    for r in copies:  # the answer is the tool's result, whatever it was
        shown = r["prompt"].rsplit("<|tool|>", 1)[1].split("\n")[0]
        assert r["response"] == c.answer_text(shown)


def test_the_reward_reads_the_last_answer_of_the_conversation():
    call = c.tool_call_text("2*3")
    good = [
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "The answer is 6."},
    ]
    assert c.final_answer([good, good[:1], good[-1:], [{"role": "assistant", "content": "7"}]], ["6"] * 4) == [
        1.0,
        0.0,  # ended on a call: no answer
        1.0,
        0.0,
    ]
    assert c.tool_calls([good, good[-1:]]) == [1.0, 0.0]


def run_calculator_tool(tmp_path, cache_dir, iterations: int, every: int, capsys) -> dict:
    """``python train.py experiment=calculator_tool`` for ``iterations`` iterations, evaluated
    every ``every``, in this process: the recipe builds into ``cache_dir``, and the table with its
    row without the tool, eval.json and the curve are written. Returns eval.json."""
    from ppo_lightning.jobs.run import train
    from tests.conftest import compose_cfg

    run = tmp_path / "run"
    overrides = [f"trainer.max_steps={iterations}", f"eval.every_n_iterations={every}", "logger=csv"]
    cfg = compose_cfg([*overrides, "trainer.enable_progress_bar=false"], run, cache_dir, experiment="calculator_tool")
    train(cfg)
    out = capsys.readouterr().out
    assert "calculator_tool: held-out prompts, before and after PPO" in out and "without the tool" in out
    result = json.loads((run / "eval.json").read_text())
    assert [c["step"] for c in result["curve"]] == list(range(0, iterations + 1, every))
    assert (run / "eval_curve.png").exists()
    return result


@pytest.mark.slow
def test_calculator_tool_builds_trains_and_reports_at_a_small_scale(tmp_path, capsys, monkeypatch):
    """The whole job, its recipe built small (20 SFT steps on the transcripts of 600 problems, 200
    RL problems): the build, the evaluations with the tool and the accuracy without it before and
    after, and the report. The demo at full size is ``test_calculator_tool_learns_to_call_the_tool``."""
    from ppo_lightning.recipes.calculator_tool import recipe
    from tests.helpers import build_small

    build_small(monkeypatch, recipe, {"SFT_STEPS": 20, "SFT_PROBLEMS": 600, "N_PROBLEMS": 200})
    result = run_calculator_tool(tmp_path, tmp_path / "cache", 2, 1, capsys)
    assert set(result["before"]) == {*recipe.ROWS, recipe.WITHOUT_TOOL} == set(result["after"])
    assert 0 <= result["without_tool"]["before"] <= 1 and 0 <= result["without_tool"]["after"] <= 1


@pytest.mark.slow
@pytest.mark.demo
def test_calculator_tool_learns_to_call_the_tool(tmp_path, cache_dir, capsys):
    """``python train.py experiment=calculator_tool`` for 4 of its 12 iterations (about 3 minutes,
    most of it the SFT warm start): before RL the greedy policy answers in its head and is almost
    never right; after, it calls the calculator and is right much more often, while without the
    tool it stays wrong."""
    result = run_calculator_tool(tmp_path, cache_dir, 4, 2, capsys)
    before, after = result["before"], result["after"]
    assert before["accuracy with the tool (greedy)"] < 0.1 and before["tool calls per episode"] < 0.2
    assert after["accuracy with the tool (greedy)"] > before["accuracy with the tool (greedy)"] + 0.3, (before, after)
    assert after["tool calls per episode"] > 0.8
    assert result["without_tool"]["after"] < 0.1
