"""Kill, stop and full-disk runs and their resumes on two processes: ``tests/resume.py`` holds the
checks, ``test_reliability.py`` their one-process cases. Each switch where it adds something: a
kill under FSDP (full-state checkpoints) and under DDP with tool episodes, a SIGTERM reaching
rank 0 only under FSDP with LoRA, a full disk under DDP and in a sharded checkpoint's write
(whose resume replays the full-state run: ``SAME_TRAJECTORY``)."""

from __future__ import annotations

import pytest

from tests.resume import (
    a_full_disk_stops_every_rank_with_one_line_and_the_run_resumes,
    sigkill_then_resume_replays_the_uninterrupted_trajectory,
    sigterm_checkpoints_the_iteration_exits_143_and_resumes,
)

pytestmark = pytest.mark.slow  # every test runs two-process jobs in subprocesses


@pytest.mark.parametrize("switch", ["fsdp_cpu", "env_tools_ddp_cpu"])
def test_sigkill_then_resume_replays_the_uninterrupted_trajectory(tmp_path, tmp_path_factory, cache_dir, switch):
    sigkill_then_resume_replays_the_uninterrupted_trajectory(tmp_path, tmp_path_factory, cache_dir, switch)


@pytest.mark.parametrize("switch", ["lora_fsdp_cpu"])
def test_sigterm_checkpoints_the_iteration_exits_143_and_resumes(tmp_path, tmp_path_factory, cache_dir, switch):
    sigterm_checkpoints_the_iteration_exits_143_and_resumes(tmp_path, tmp_path_factory, cache_dir, switch)


@pytest.mark.parametrize("switch", ["ddp_cpu", "dcp_fsdp_cpu"])
def test_a_full_disk_stops_every_rank_with_one_line_and_the_run_resumes(tmp_path, tmp_path_factory, cache_dir, switch):
    a_full_disk_stops_every_rank_with_one_line_and_the_run_resumes(tmp_path, tmp_path_factory, cache_dir, switch)
