"""`millpond status`: one screen of a real service while data flows and callers wait."""

import contextlib
import re
import threading
import time

from millpond import ReplayClient, TableConfig
from millpond.cli import main
from millpond.errors import MillpondError
from millpond.service.server import ServerConfig, create_server
from millpond.testing import constant_segment


def test_status_shows_rates_fill_and_who_waits_for_what(tmp_path, capsys):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard")))
    address = f"127.0.0.1:{port}"
    stop = threading.Event()
    try:
        with ReplayClient([address], colocated=False) as client:
            spi = TableConfig.uniform(
                "paced", 200, min_size=8, samples_per_insert=4.0, error_buffer=8.0
            )
            client.create_table(spi)
            with client.writer("paced", "w0") as writer:
                writer.write_segment(*constant_segment(0, length=8), episode_id=0)
            client.sample("paced", 32)  # diff 32 -> 0, below the bound of 24: samples wait

            def sample_more() -> None:  # more than the ratio allows: held back
                with contextlib.suppress(MillpondError):  # ends with the server
                    client.sample("paced", 64, timeout_s=20)

            waiter = threading.Thread(target=sample_more, daemon=True)
            waiter.start()

            def write() -> None:  # a steady writer on another table while status looks
                client.create_table(TableConfig.uniform("fast", 4000))
                with client.writer("fast", "w1") as w:
                    episode = 1
                    while not stop.is_set():
                        w.write_segment(*constant_segment(episode, length=8), episode_id=episode)
                        episode += 1
                        time.sleep(0.01)

            writing = threading.Thread(target=write, daemon=True)
            writing.start()
            time.sleep(0.5)
            assert main(["status", address, "--interval", "1"]) == 0
            screen = capsys.readouterr().out
            stop.set()
            writing.join(10)
    finally:
        stop.set()
        running.stop(grace=1)
    rows = [re.split(r"\s{2,}", line.strip()) for line in screen.splitlines()[1:]]
    columns = {row[1]: row for row in rows if row[0] == address}
    assert set(columns) == {"paced", "fast"}, screen
    paced, fast = "  ".join(columns["paced"]), "  ".join(columns["fast"])
    assert columns["paced"][3:5] == ["8 / 200", "4%"] and columns["paced"][7] == "4.00 (4)"
    # diff 0, 24 below the lower bound: 6 more inserted steps at 4 samples each
    assert "1 sample(s) wait: 6 more inserted steps needed at samples_per_insert 4" in paced
    assert "(none)" in fast and "nobody" in fast
    insert_rate = float(columns["fast"][5].replace(",", ""))
    assert insert_rate > 0  # the writer's steps per second, between the two snapshots
    assert columns["fast"][8] == "1"  # one Insert stream open
    assert "weights version: none published" in screen
