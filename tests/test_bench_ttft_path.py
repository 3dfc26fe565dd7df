"""bench/probes/ttft_path.py (where a lone streamed request's time to first token goes through the
server): its hops' windowing and table, and its traced pipe's marks; the run itself starts servers
(seconds), left to the probe."""
from conftest import probe

ttft_path = probe("ttft_path")


def test_each_request_takes_its_own_hops_the_streams_after_its_tokens():
    ms = 1_000_000
    marks = [("accept", 1 * ms), ("advance", 2 * ms), ("engine:add", 3 * ms),
             ("front unpickled", 5 * ms), ("advance", 6 * ms), ("engine:add", 7 * ms),
             ("accept", 21 * ms), ("front unpickled", 25 * ms), ("advance", 26 * ms)]
    first, second = ttft_path.per_request(marks, [(0, 8 * ms), (20 * ms, 30 * ms)])
    # a hop's first time in its request's window; a Stream's advance only once its tokens came
    assert first == {"client send": 0, "client first content": 8 * ms, "accept": 1 * ms,
                     "engine:add": 3 * ms, "front unpickled": 5 * ms, "advance": 6 * ms}
    assert second == {"client send": 0, "client first content": 10 * ms, "accept": 1 * ms,
                      "front unpickled": 5 * ms, "advance": 6 * ms}
    lines = ttft_path.table({"a": [first, second]}).splitlines()
    row = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines[2:]}
    assert row["advance"] == ["6.00 / 6.00", "1.00 |"]  # since front unpickled
    assert row["engine:add"] == ["3.00 / 3.00", "2.00 |"]  # one request has it
    assert row["engine:recv"] == ["-", "- |"]


def test_a_traced_connection_marks_requests_and_tokens_not_the_rest():
    from multiprocessing import Pipe

    here, there = Pipe()
    traced = ttft_path.TracedConnection(there, "got", "unpickled", "send", "sent",
                                        ttft_path.wanted)
    ttft_path.MARKS.clear()
    for message in [("add", 0, "generation"), ("cancel", 0), ([(0, None)], None), ([], "load")]:
        here.send(message)
        assert traced.recv() == message
        traced.send(message)
        assert here.recv() == message
    hops = [hop for hop, _ in ttft_path.MARKS]
    assert hops == ["got", "unpickled", "send", "sent"] * 2
