#!/usr/bin/env bash
# The fault matrix alone (every fault test, slow ones included), its accounting table kept in
# bench/out/fault-matrix.md:   bash bench/faults.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/out
AWRL_FAULT_TABLE=bench/out/fault-matrix.md .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_faults.py tests/test_faults_trainer.py tests/test_fuzz.py tests/test_outbox.py \
  "tests/test_ledger.py::test_writer_killed_with_sigkill_loses_nothing_duplicates_nothing" \
  "tests/test_rollout.py::test_killed_browser_ends_episode_as_env_error_and_worker_goes_on" \
  "tests/test_train_resume.py::test_sigkilled_trainer_resumes_without_losing_or_repeating_a_group"
cat bench/out/fault-matrix.md
