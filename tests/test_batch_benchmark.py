"""benchmarks/batch.py's input: the serving benchmark's request bodies, one image file each, made in a
process pool for large jobs; every line must be the body serve.py would send, naming its own file."""

import json

import pytest

from app.media.synthetic import image_bytes
from benchmarks.batch import write_requests
from benchmarks.serve import Workload


@pytest.mark.parametrize("n", [3, 300])  # below and above the pool's threshold
def test_requests_are_the_serving_bodies_with_their_own_files(tmp_path, n):
    path = write_requests(tmp_path, n, 96, 32, 16, "files")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"img-{i}" for i in range(n)]
    work = Workload("image", image_size=96, prompt_words=32, output_tokens=16)
    for i in {0, n // 2, n - 1}:
        body = work.body(i)
        body.pop("stream_options")
        body["messages"][0]["content"][0]["image_url"]["url"] = f"{i:07d}.jpg"
        assert lines[i] == {"id": f"img-{i}", **body}
        assert (tmp_path / "images" / f"{i:07d}.jpg").read_bytes() == image_bytes(96, 96, i, "JPEG")
    assert len(list((tmp_path / "images").glob("*.jpg"))) == n


def test_data_urls_inline_the_image(tmp_path):
    path = write_requests(tmp_path, 2, 64, 8, 4, "data")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    body = Workload("image", image_size=64, prompt_words=8, output_tokens=4).body(1)
    body.pop("stream_options")
    assert lines[1] == {"id": "img-1", **body}
