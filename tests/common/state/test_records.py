"""Request and session records against a real redis-server on loopback."""

from __future__ import annotations

import re
import time

import pytest

from common.state.records import (
    RequestRecord,
    RequestStore,
    SessionRecord,
    SessionStore,
    pack_token_ids,
    unpack_token_ids,
)


def make_request(request_id: str = "r1", **overrides) -> RequestRecord:
    values = dict(
        request_id=request_id,
        status="queued",
        prefill_worker_id="p0",
        num_prompt_tokens=17,
        deadline_s=1700000030.125,
        created_at=1700000000.5,
        updated_at=1700000000.5,
        route_reason="least loaded prefill; decode with most free blocks",
    )
    return RequestRecord(**(values | overrides))


def wait_until(predicate, timeout_s: float, poll_s: float = 0.01) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start


# ------------------------------------------------------------------------------------------ requests


def test_create_get_round_trip_is_exact(client):
    store = RequestStore(client)
    record = make_request()
    store.create(record)
    assert store.get("r1") == record
    assert store.get("r2") is None
    assert 3_590_000 < client.pttl("pdserve:request:r1") <= 3_600_000
    raw = client.hgetall("pdserve:request:r1")
    fields = [raw[b"status"], raw[b"num_prompt_tokens"], raw[b"deadline_s"]]
    assert fields == [b"queued", b"17", b"1700000030.125"]


def test_no_deadline_round_trips_as_none(client):
    store = RequestStore(client)
    store.create(make_request(deadline_s=None))
    assert store.get("r1").deadline_s is None
    assert client.hget("pdserve:request:r1", "deadline_s") == b""


def test_create_twice_is_an_error(client):
    store = RequestStore(client)
    store.create(make_request())
    with pytest.raises(ValueError, match="request record 'r1' already exists"):
        store.create(make_request(status="decoding"))
    assert store.get("r1").status == "queued"


def test_update_sets_only_the_given_fields_and_keeps_the_ttl(client):
    store = RequestStore(client)
    store.create(make_request())
    client.pexpire("pdserve:request:r1", 5_000)
    store.update("r1", status="decoding", decode_worker_id="d1", num_tokens_emitted=5, updated_at=1700000002.0)
    assert store.get("r1") == make_request(
        status="decoding", decode_worker_id="d1", num_tokens_emitted=5, updated_at=1700000002.0
    )
    assert 4_000 < client.pttl("pdserve:request:r1") <= 5_000
    # Integers are stored in decimal, so an emitter may count with HINCRBY.
    assert client.hincrby("pdserve:request:r1", "num_tokens_emitted", 2) == 7
    assert store.get("r1").num_tokens_emitted == 7


def test_update_stamps_updated_at(client):
    store = RequestStore(client)
    store.create(make_request())
    before = time.time()
    store.update("r1", status="prefilling")
    assert before <= store.get("r1").updated_at <= time.time()


def test_update_of_an_unknown_request_is_a_key_error_and_writes_nothing(client):
    store = RequestStore(client)
    with pytest.raises(KeyError, match="no request record 'ghost'"):
        store.update("ghost", status="decoding")
    assert client.exists("pdserve:request:ghost") == 0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"colour": "red"}, "cannot update request field 'colour'"),
        ({"request_id": "r2"}, "cannot update request field 'request_id'"),
        ({"status": "thinking"}, "got 'thinking'"),
        ({"status": "finished"}, "status 'finished' is terminal: call finish()"),
        ({"num_tokens_emitted": "many"}, "'num_tokens_emitted' must be int, got 'many'"),
        ({"error": 3}, "'error' must be str, got 3"),
    ],
)
def test_update_names_a_bad_field_or_value(client, fields, message):
    store = RequestStore(client)
    store.create(make_request())
    with pytest.raises(ValueError, match=re.escape(message)):
        store.update("r1", **fields)
    assert store.get("r1") == make_request()


def test_finish_sets_the_short_ttl_and_the_record_is_gone_after_it(client):
    store = RequestStore(client, finished_ttl_s=0.3)
    store.create(make_request(status="decoding", num_tokens_emitted=9))
    store.finish("r1", "finished", finish_reason="length")
    record = store.get("r1")
    assert (record.status, record.finish_reason, record.error, record.num_tokens_emitted) == (
        "finished",
        "length",
        "",
        9,
    )
    assert 0 < client.pttl("pdserve:request:r1") <= 300
    wait_until(lambda: client.exists("pdserve:request:r1") == 0, timeout_s=0.5)
    assert store.get("r1") is None


def test_finish_default_ttl_is_60_s(client):
    store = RequestStore(client)
    store.create(make_request())
    store.finish("r1", "failed", error="decode worker d1 unreachable")
    assert store.get("r1").error == "decode worker d1 unreachable"
    assert 59_000 < client.pttl("pdserve:request:r1") <= 60_000


def test_finish_validates_and_rejects_unknown_requests(client):
    store = RequestStore(client)
    with pytest.raises(ValueError, match="got 'decoding'"):
        store.finish("r1", "decoding")
    with pytest.raises(KeyError, match="'ghost'"):
        store.finish("ghost", "aborted")
    assert client.exists("pdserve:request:ghost") == 0


def test_delete_is_idempotent(client):
    store = RequestStore(client)
    store.create(make_request())
    assert store.delete("r1") is True
    assert store.delete("r1") is False
    assert store.get("r1") is None


def test_unknown_fields_from_a_newer_writer_are_ignored(client):
    store = RequestStore(client)
    store.create(make_request())
    client.hset("pdserve:request:r1", "kv_transport", "shm")
    assert store.get("r1") == make_request()


def test_request_record_validates_status():
    with pytest.raises(ValueError, match="got 'done'"):
        make_request(status="done")


# ------------------------------------------------------------------------------------------ sessions


def test_session_put_get_append_exact(client):
    store = SessionStore(client)
    history = [151643, 0, 1, 2**32 - 1, 872]
    record = SessionRecord(session_id="s1", token_ids=history, decode_worker_id="d1", updated_at=1700000000.5)
    store.put(record)
    assert store.get("s1") == record
    assert len(client.hget("pdserve:session:s1", "token_ids")) == 4 * len(history)
    assert 1_790_000 < client.pttl("pdserve:session:s1") <= 1_800_000

    client.pexpire("pdserve:session:s1", 5_000)
    before = time.time()
    assert store.append_tokens("s1", [151645, 0]) == 7
    record = store.get("s1")
    assert record.token_ids == history + [151645, 0]
    assert record.decode_worker_id == "d1"
    assert before <= record.updated_at <= time.time()
    assert client.pttl("pdserve:session:s1") > 1_790_000  # append restarts the TTL
    assert store.append_tokens("s1", []) == 7


def test_session_put_replaces_and_empty_history_works(client):
    store = SessionStore(client)
    store.put(SessionRecord(session_id="s1", token_ids=[5, 6, 7], decode_worker_id="d1"))
    replacement = SessionRecord(session_id="s1", token_ids=[], decode_worker_id="d2", updated_at=3.0)
    store.put(replacement)
    assert store.get("s1") == replacement
    assert store.append_tokens("s1", [9]) == 1
    assert store.get("s1").token_ids == [9]


def test_long_session_round_trips(client):
    store = SessionStore(client)
    history = [(i * 7919) % 152064 for i in range(20_000)]
    store.put(SessionRecord(session_id="s1", token_ids=history))
    assert store.get("s1").token_ids == history


def test_append_to_an_unknown_session_is_a_key_error_and_writes_nothing(client):
    store = SessionStore(client)
    with pytest.raises(KeyError, match="no session 'ghost'"):
        store.append_tokens("ghost", [1])
    assert client.exists("pdserve:session:ghost") == 0


@pytest.mark.parametrize("bad", [-1, 2**32, 1.0, True])
def test_out_of_range_token_ids_are_named_and_nothing_is_written(client, bad):
    store = SessionStore(client)
    message = f"token id at index 1 must be an int in [0, 4294967295], got {bad!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        store.put(SessionRecord(session_id="s1", token_ids=[1, bad]))
    assert store.get("s1") is None


def test_session_delete_is_idempotent(client):
    store = SessionStore(client)
    store.put(SessionRecord(session_id="s1", token_ids=[1]))
    assert store.delete("s1") is True
    assert store.delete("s1") is False
    assert store.get("s1") is None


def test_token_packing_is_little_endian_uint32():
    assert pack_token_ids([1, 151643]) == b"\x01\x00\x00\x00\x5b\x50\x02\x00"
    assert unpack_token_ids(b"\x01\x00\x00\x00\x5b\x50\x02\x00") == [1, 151643]
    with pytest.raises(ValueError, match="multiple of 4 bytes, got 3"):
        unpack_token_ids(b"abc")
