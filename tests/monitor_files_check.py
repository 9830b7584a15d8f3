#!/usr/bin/env python3
"""Checks the monitors' files of a `strata train` run against its metrics file
(--metrics), with nothing but Python's standard library: its own CRC-32C and
protobuf decoding, written apart from strata's writer.

TensorBoard (--events FILE): every record's framing (uint64 length, masked
CRC-32C of the length, data, masked CRC-32C of the data) and both CRCs; the
first event is file_version "brain.Event:2"; then one scalar event per value,
and every scalar of every step is there, once, at the step's samples (the
metrics' sequence_offset), with the metrics' value as a float32:
Train/Samples/train_loss (loss), eval_loss (when evaluated), lr, grad_norm,
loss_scale (fp16), tokens_per_s, step_time_s and nvme_gb_per_s ((nvme bytes
read + written) / step_time_s / 1e9). Nothing else is in the file.

CSV (--csv DIR): DeepSpeed's csv_monitor layout, the files its csvMonitor
writes for those values (Python's csv module, as DeepSpeed's code writes
them, into a scratch folder) byte for byte, and no other file.

A value the metrics file writes as null (not finite) must be NaN or infinite.
Exits 0 when everything matches; otherwise prints the first mismatch (file,
byte offset or tag and step) and exits 1.
Usage: monitor_files_check.py --metrics FILE.jsonl [--events FILE] [--csv DIR]
"""
import argparse
import csv
import json
import math
import os
import struct
import sys
import tempfile

# --- CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) ----------------------------


def _crc_table():
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked(crc):
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


class Mismatch(Exception):
    pass


# --- TFRecord and protobuf -----------------------------------------------------------


def records(path):
    """The data of each record, each framing and CRC checked."""
    data = open(path, "rb").read()
    at = 0
    out = []
    while at < len(data):
        if len(data) - at < 12:
            raise Mismatch(f"{path}: a record header cut short at byte {at}")
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[at + 8:at + 12])
        if length_crc != masked(crc32c(header)):
            raise Mismatch(f"{path}: the length's CRC at byte {at + 8} does not match")
        if len(data) - at - 12 < length + 4:
            raise Mismatch(f"{path}: a record of {length} bytes cut short at byte {at}")
        body = data[at + 12:at + 12 + length]
        (body_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        if body_crc != masked(crc32c(body)):
            raise Mismatch(f"{path}: the data's CRC of the record at byte {at} does not match")
        out.append((at, body))
        at += 16 + length
    return out


def varint(data, at):
    value, shift = 0, 0
    while True:
        if at >= len(data):
            raise Mismatch("a varint runs past the end of its message")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def fields(data):
    """(field number, wire type, value) of a message: ints, 8 or 4 raw bytes, or bytes."""
    at = 0
    while at < len(data):
        key, at = varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = varint(data, at)
        elif wire == 1:
            value, at = data[at:at + 8], at + 8
        elif wire == 5:
            value, at = data[at:at + 4], at + 4
        elif wire == 2:
            length, at = varint(data, at)
            value, at = data[at:at + length], at + length
        else:
            raise Mismatch(f"wire type {wire} is not one an Event uses")
        if at > len(data):
            raise Mismatch("a field runs past the end of its message")
        yield number, wire, value


def decode_event(data):
    """An Event as a dict: wall_time, step, file_version, scalars [(tag, float32)]."""
    event = {"wall_time": 0.0, "step": 0, "file_version": None, "scalars": []}
    for number, wire, value in fields(data):
        if number == 1 and wire == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3 and wire == 2:
            event["file_version"] = value.decode()
        elif number == 5 and wire == 2:
            for vnumber, vwire, summary_value in fields(value):
                if vnumber != 1 or vwire != 2:
                    continue
                tag, simple = None, None
                for snumber, swire, item in fields(summary_value):
                    if snumber == 1 and swire == 2:
                        tag = item.decode()
                    elif snumber == 2 and swire == 5:
                        simple = struct.unpack("<f", item)[0]
                event["scalars"].append((tag, simple))
    return event


# --- what the metrics say --------------------------------------------------------------


def expected_events(metrics_path):
    """(tag, value or None for not finite, step) in the order strata writes them."""
    events = []
    for line in open(metrics_path):
        m = json.loads(line)
        samples = m["sequence_offset"]
        seconds = m["step_time_s"]
        nvme = (m["nvme_read_bytes"] + m["nvme_written_bytes"]) / seconds / 1e9 if seconds > 0 else 0.0
        values = [("train_loss", m["loss"])]
        if "eval_loss" in m:
            values.append(("eval_loss", m["eval_loss"]))
        values += [("lr", m["lr"]), ("grad_norm", m["grad_norm"])]
        if "loss_scale" in m:
            values.append(("loss_scale", m["loss_scale"]))
        values += [("tokens_per_s", m["tokens_per_s"]), ("step_time_s", seconds),
                   ("nvme_gb_per_s", nvme)]
        events += [("Train/Samples/" + name, value, samples) for name, value in values]
    return events


def float32(value):
    return struct.unpack("<f", struct.pack("<f", value))[0]


def same_scalar(expected, got):
    if expected is None:
        return got is not None and not math.isfinite(got)
    return got is not None and struct.pack("<f", float32(expected)) == struct.pack("<f", got)


def check_events(path, expected):
    framed = records(path)
    if not framed:
        raise Mismatch(f"{path}: no records")
    first = decode_event(framed[0][1])
    if first["file_version"] != "brain.Event:2":
        raise Mismatch(f"{path}: the first event's file_version is {first['file_version']!r}")
    got = []
    for at, body in framed[1:]:
        event = decode_event(body)
        if len(event["scalars"]) != 1:
            raise Mismatch(f"{path}: the event at byte {at} holds {len(event['scalars'])} values, not 1")
        if not event["wall_time"] > 0:
            raise Mismatch(f"{path}: the event at byte {at} has no wall time")
        tag, value = event["scalars"][0]
        got.append((tag, value, event["step"], at))
    if len(got) != len(expected):
        raise Mismatch(f"{path}: {len(got)} scalar events, the metrics make {len(expected)}")
    for (tag, value, step, at), (want_tag, want_value, want_step) in zip(got, expected):
        if (tag, step) != (want_tag, want_step):
            raise Mismatch(f"{path}: at byte {at}: {tag} at step {step}, expected {want_tag} at {want_step}")
        if not same_scalar(want_value, value):
            raise Mismatch(f"{path}: {tag} at step {step} is {value!r}, the metrics say {want_value!r}")
    return len(got)


# DeepSpeed's csvMonitor.write_events (deepspeed/monitor/csv_monitor.py), as it writes.
def write_deepspeed_csv(log_dir, events):
    filenames = []
    for log_name, value, step in events:
        header = log_name.split("/")[-1] if "/" in log_name else log_name
        filename = log_name.replace("/", "_").replace(" ", "_")
        with open(log_dir + "/" + filename + ".csv", "a+") as csv_monitor_file:
            writer = csv.writer(csv_monitor_file)
            if filename not in filenames:
                filenames.append(filename)
                writer.writerow(["step", header])
            writer.writerow([step, value])


def check_csv(directory, expected):
    # A value the metrics give as null is NaN or infinite in strata's file: read it back there.
    resolved = []
    for tag, value, step in expected:
        if value is None:
            name = tag.replace("/", "_").replace(" ", "_") + ".csv"
            rows = [r for r in csv.reader(open(os.path.join(directory, name), newline="")) if r[0] == str(step)]
            if not rows or rows[0][1] not in ("nan", "inf", "-inf"):
                raise Mismatch(f"{directory}/{name}: step {step} is {rows[0][1] if rows else 'missing'}, "
                               "the metrics say it is not finite")
            value = float(rows[0][1])
        resolved.append((tag, value, step))
    with tempfile.TemporaryDirectory() as scratch:
        write_deepspeed_csv(scratch, resolved)
        want = sorted(os.listdir(scratch))
        have = sorted(os.listdir(directory))
        if want != have:
            raise Mismatch(f"{directory}: files {have}, DeepSpeed writes {want}")
        for name in want:
            ours = open(os.path.join(directory, name), "rb").read()
            theirs = open(os.path.join(scratch, name), "rb").read()
            if ours != theirs:
                at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                raise Mismatch(f"{directory}/{name}: differs from DeepSpeed's at byte {at}: "
                               f"{ours[max(0, at - 20):at + 20]!r} vs {theirs[max(0, at - 20):at + 20]!r}")
    return len(want)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--events")
    parser.add_argument("--csv")
    args = parser.parse_args()
    assert crc32c(b"123456789") == 0xE3069283, "CRC-32C check value"
    expected = expected_events(args.metrics)
    if not expected:
        print(f"{args.metrics}: no steps")
        return 1
    try:
        if args.events:
            n = check_events(args.events, expected)
            print(f"{args.events}: {n} scalars match {args.metrics}, every record's CRCs hold")
        if args.csv:
            n = check_csv(args.csv, expected)
            print(f"{args.csv}: {n} files as DeepSpeed's csv_monitor writes {args.metrics}'s values")
    except Mismatch as mismatch:
        print(f"mismatch: {mismatch}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
