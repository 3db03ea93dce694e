"""Fixtures of the image-prompt tests (test_images.py, test_image_stages.py): the bundled pictures drawn afresh and
the tiny random Qwen2.5-VL target (:mod:`eagle3_data.tiny_vlm`), each made once per session."""

from __future__ import annotations

import pytest

from eagle3_data import tiny_vlm


@pytest.fixture(scope="session")
def pictures(tmp_path_factory):
    return tiny_vlm.draw_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="session")
def target(tmp_path_factory):
    return tiny_vlm.build_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen2.5-vl"))
