"""``tinygpt serve --replicas 2`` on a local Ray cluster (one cluster for the module: Ray's start is most of the
time): the API through Ray's proxy, greedy answers over both replicas equal to offline ``generate``, and a replica
process killed while requests run -- what each request got, none hanging, the replica back."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("ray.serve", reason="needs the cluster extra: pip install -e '.[cluster]'")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from serving_support import offline, tiny_model, tokenizer  # noqa: E402

from tinygpt.checkpoint import save_model  # noqa: E402
from tinygpt.serving.options import ServeOptions  # noqa: E402
from tinygpt.serving.replica_options import ReplicaOptions  # noqa: E402

pytestmark = pytest.mark.slow
CONTEXT = 1024
PROMPTS = ["The quick brown fox", "Every effort moves you", "Name a colour.", "a café serves", "Below is an",
           "The lazy dog", "Write a response", "naïve résumé"]
LONG_TOKENS = 900  # long enough that a stream is still running when its replica is killed (~1 s at full speed)
WAIT_S = 120.0  # every wait below is bounded by this


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_pids() -> set[int]:
    """The replica processes of the cluster this test process started (its own descendants, so never another
    user's Ray)."""
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if "ServeReplica:tinygpt" in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.add(proc.pid)
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tinygpt.serving import replicas

    model = tiny_model(context_length=CONTEXT)
    folder = tmp_path_factory.mktemp("replicas") / "tiny"
    save_model(model, folder, tokenizer())
    options = ServeOptions(port=_free_port(), model_name="tiny", max_batch=16, log_level="warning")
    started = time.monotonic()
    url = replicas.run_replicas(str(folder), options, ReplicaOptions(replicas=2), device="cpu")
    print(f"\nRay cluster + 2 replicas up in {time.monotonic() - started:.1f} s")
    try:
        yield url, model
    finally:
        replicas.shutdown()


def _complete(url: str, prompt: str, max_tokens: int) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0}, timeout=WAIT_S)


def test_models_and_a_stream_through_the_openai_client(cluster):
    url, model = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True))
    expected = tokenizer().decode(offline(model, tokenizer().encode(PROMPTS[0]), 12))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_sixteen_greedy_requests_over_both_replicas_equal_offline_generate(cluster):
    url, model = cluster
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    answers: dict[int, httpx.Response] = {}

    def ask(i: int) -> None:
        answers[i] = _complete(url, prompts[i], 16)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert sorted(answers) == list(range(16))
    for i, response in answers.items():
        assert response.status_code == 200, response.text
        expected = tokenizer().decode(offline(model, tokenizer().encode(prompts[i]), 16))
        assert response.json()["choices"][0]["text"] == expected, prompts[i]
    served_by = {r.headers["x-tinygpt-replica"] for r in answers.values()}
    assert len(served_by) == 2, served_by  # Ray spread them over both replicas


def _stream(url: str, prompt: str, first: threading.Barrier, out: dict[str, object]) -> None:
    """One streamed completion; ``out`` gets the status, the replica, the data lines, and how it ended."""
    out["lines"] = lines = []
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=WAIT_S,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": LONG_TOKENS, "temperature": 0,
                                "stream": True}) as response:
            out["status"], out["replica"] = response.status_code, response.headers.get("x-tinygpt-replica")
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 1:
                        first.wait()
        out["end"] = "closed"
    except Exception as err:  # noqa: BLE001 -- the table records whatever happened
        out["end"] = f"{type(err).__name__}: {err}"
    finally:
        if len(lines) == 0:
            first.abort()


def _outcome(result: dict[str, object]) -> str:
    lines = result.get("lines", [])
    if result.get("end") != "closed":
        return f"transport error ({result.get('end')})"
    if lines[-1:] != ["data: [DONE]"]:
        return "no [DONE]"
    if any('"error"' in line for line in lines):
        return "error event + [DONE]"
    return "complete"


def test_a_killed_replica_ends_its_requests_with_an_error_and_comes_back(cluster):
    url, model = cluster
    before = _replica_pids()
    assert len(before) == 2, before
    count = 8
    first = threading.Barrier(count + 1, timeout=WAIT_S)
    results: list[dict[str, object]] = [{} for _ in range(count)]
    answers: dict[int, httpx.Response | str] = {}

    def ask(i: int) -> None:  # non-streaming requests alongside, wherever Ray sends them
        try:
            answers[i] = _complete(url, PROMPTS[i], LONG_TOKENS)
        except httpx.HTTPError as err:
            answers[i] = f"{type(err).__name__}: {err}"

    threads = [threading.Thread(target=_stream, args=(url, PROMPTS[i], first, results[i])) for i in range(count)]
    plain = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in plain + threads:
        t.start()
    first.wait()  # every stream has its first event: each is running on a replica
    victim = max(before, key=lambda pid: sum(str(r.get("replica", "")).startswith(f"{pid}@") for r in results))
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)  # mid-generation: a stream runs ~1 s at full speed after its first event
    for t in threads + plain:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads + plain), "a request hung"

    table = [(i, str(r.get("replica", "")).split("@")[0], _outcome(r), len(r["lines"])) for i, r in
             enumerate(results)]
    print("\nrequest | replica | outcome | data lines\n" + "\n".join(" | ".join(map(str, row)) for row in table))
    on_victim = [row for row in table if row[1] == str(victim)]
    assert on_victim and all(row[2] == "error event + [DONE]" for row in on_victim), table
    assert all(row[2] == "complete" for row in table if row[1] != str(victim)), table
    assert all(r["status"] == 200 for r in results)
    got = {i: a if isinstance(a, str) else (a.status_code, a.json().get("error", {}).get("code")) for i, a in
           answers.items()}
    print("non-streaming: " + ", ".join(
        f"{i}: {v} from {'-' if isinstance(answers[i], str) else answers[i].headers.get('x-tinygpt-replica')}"
        for i, v in sorted(got.items())))
    assert sorted(got) == [0, 1, 2, 3] and all(v in ((200, None), (503, "replica_lost")) for v in got.values()), got
    error_event = next(line for line in results[on_victim[0][0]]["lines"] if '"error"' in line)
    assert "replica_lost" in error_event

    # The replica back: two replica processes again, the victim gone, and both answering.
    deadline = time.monotonic() + WAIT_S
    while not (len(now := _replica_pids()) == 2 and victim not in now):
        assert time.monotonic() < deadline, f"no replacement replica within {WAIT_S} s"
        time.sleep(0.2)
    served: set[str] = set()
    while len(served) < 2:
        assert time.monotonic() < deadline, f"the new replica did not serve within {WAIT_S} s ({served})"
        response = _complete(url, PROMPTS[1], 4)
        if response.status_code == 200:
            served.add(response.headers["x-tinygpt-replica"].split("@")[0])
        time.sleep(0.05)
    print(f"replica serving again {time.monotonic() - killed_at:.1f} s after the kill")
    assert str(victim) not in served and {int(p) for p in served} == now


def _scrape_each_replica(url: str) -> dict[str, dict[str, float]]:
    """``/metrics`` through Ray's proxy until both replicas have answered (bounded): per replica, every sample's
    value by name (labels dropped: one model per replica)."""
    from prometheus_client.parser import text_string_to_metric_families

    seen: dict[str, dict[str, float]] = {}
    for _ in range(40):
        response = httpx.get(url + "/metrics", timeout=WAIT_S)
        assert response.status_code == 200, response.text
        samples = {s.name: s.value for family in text_string_to_metric_families(response.text)
                   for s in family.samples}
        seen.setdefault(response.headers["x-tinygpt-replica"], samples)
        if len(seen) == 2:
            return seen
    raise AssertionError(f"40 scrapes reached only {sorted(seen)}")


def test_metrics_are_per_replica_and_count_what_each_replica_served(cluster):
    pytest.importorskip("prometheus_client")
    url, _ = cluster
    before = _scrape_each_replica(url)
    served: dict[str, int] = {}
    for i in range(8):
        response = _complete(url, PROMPTS[i], 6)
        assert response.status_code == 200, response.text
        replica = response.headers["x-tinygpt-replica"]
        served[replica] = served.get(replica, 0) + response.json()["usage"]["completion_tokens"]
    after = _scrape_each_replica(url)
    assert set(before) == set(after)  # the same two replicas (none was replaced meanwhile)
    for replica, samples in after.items():
        assert samples["vllm:num_requests_running"] == 0 and samples["vllm:num_requests_waiting"] == 0
        assert 0 <= samples["vllm:kv_cache_usage_perc"] <= 1
        grown = samples["vllm:generation_tokens_total"] - before[replica]["vllm:generation_tokens_total"]
        assert grown == served.get(replica, 0), replica  # each replica counts only what it served
