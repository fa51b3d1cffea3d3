"""The model families whose attention differs (Gemma's sliding windows, DeepSeek's latent KV: tests/families.py)
served by a 1P1D cluster and a colocated worker, token-exact with the prefix cache (tests/families_served.py); a
file of their own so the test runs' two processes take the families' clusters in parallel."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.families import LATENT_FAMILIES, SLIDING_FAMILIES
from tests.families_served import check_answers, serve


@pytest.fixture(scope="module", params=SLIDING_FAMILIES + LATENT_FAMILIES)
def served(request, tmp_path_factory, smollm_dir: Path):
    yield from serve(request.param, tmp_path_factory, smollm_dir)


def test_pd_and_colocated_answer_what_generate_does_with_the_prefix_cache(served):
    check_answers(served)
