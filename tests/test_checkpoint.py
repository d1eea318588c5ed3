import json

import pytest
import torch
from safetensors.torch import save_file

from mergecal.checkpoint import (MARKER, SafetensorsSource, ShardedCheckpointWriter, load_state_dict, save_checkpoint,
                                 save_state_dict)
from mergecal.errors import CheckpointError


def test_single_file_round_trip_preserves_values_and_dtypes(tmp_path, pretrained):
    sd = dict(pretrained, half=torch.randn(3, 3).to(torch.bfloat16))
    path = save_state_dict(sd, tmp_path / "m.safetensors", metadata={"backbone": "tiny"})
    source = SafetensorsSource(path)
    assert sorted(source.keys()) == sorted(sd)  # safetensors stores keys sorted
    for key, value in sd.items():
        assert source.dtype(key) == value.dtype
        assert source.shape(key) == tuple(value.shape)
        assert torch.equal(source.get(key), value)
    assert source.metadata() == {"backbone": "tiny"}


def test_same_tensors_and_metadata_give_the_same_bytes(tmp_path, pretrained):
    """safetensors writes __metadata__ in a random order (safetensors#584); saved files must not."""
    metadata = {f"key{i:02d}": f"value {i} é" for i in range(16)}
    single = [save_state_dict(pretrained, tmp_path / f"m{i}.safetensors", metadata=metadata).read_bytes()
              for i in range(6)]
    assert len(set(single)) == 1
    header = json.loads(single[0][8:8 + int.from_bytes(single[0][:8], "little")])
    assert list(header["__metadata__"]) == sorted(metadata)
    assert SafetensorsSource(tmp_path / "m0.safetensors").metadata() == metadata
    loaded = load_state_dict(tmp_path / "m0.safetensors")
    assert all(torch.equal(loaded[k], pretrained[k]) for k in pretrained)
    sharded = [{p.name: p.read_bytes() for p in
                save_checkpoint(pretrained, tmp_path / f"c{i}", max_shard_bytes=600, metadata=metadata).iterdir()}
               for i in range(4)]
    assert len(sharded[0]) > 2 and all(s == sharded[0] for s in sharded)


def test_sharded_checkpoint_is_written_in_bounded_shards_and_read_back_lazily(tmp_path, pretrained):
    out = save_checkpoint(pretrained, tmp_path / "ckpt", max_shard_bytes=600)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    for shard in shards:  # no shard holds more than one over-size tensor beyond the limit
        with_one = SafetensorsSource(out / shard)
        sizes = [with_one.get(k).numel() * with_one.get(k).element_size() for k in with_one.keys()]
        assert sum(sizes) <= 600 or len(sizes) == 1
    source = SafetensorsSource(out)  # directory -> index
    assert set(source.keys()) == set(pretrained)
    assert all(torch.equal(source.get(k), pretrained[k]) for k in pretrained)
    assert list(load_state_dict(out / "model.safetensors.index.json")) == source.keys()


def test_one_shard_is_written_as_model_safetensors(tmp_path, pretrained):
    out = save_checkpoint(pretrained, tmp_path / "ckpt")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "model.safetensors"]  # MARKER: mergecal wrote it


def test_interrupted_write_leaves_nothing_behind(tmp_path, pretrained):
    def items():
        yield "a", torch.ones(3)
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        save_checkpoint(items(), tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_rewrite_replaces_existing_checkpoint_completely(tmp_path):
    save_checkpoint({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "ckpt", max_shard_bytes=8)
    save_checkpoint({"c": torch.zeros(2)}, tmp_path / "ckpt")
    assert SafetensorsSource(tmp_path / "ckpt").keys() == ["c"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_missing_path_and_missing_shard_are_named(tmp_path, pretrained):
    with pytest.raises(CheckpointError, match="not found"):
        SafetensorsSource(tmp_path / "nope.safetensors")
    out = save_checkpoint(pretrained, tmp_path / "ckpt", max_shard_bytes=600)
    victim = sorted(out.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        SafetensorsSource(out)


def test_pickle_files_are_refused(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"a": torch.ones(1)}, path)
    with pytest.raises(CheckpointError, match="pickled checkpoints are not read"):
        SafetensorsSource(path)


def test_corrupt_file_and_bad_index_give_clear_errors(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        SafetensorsSource(bad)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{\"no_weight_map\": 1}")
    with pytest.raises(CheckpointError, match="weight_map"):
        SafetensorsSource(index)


def test_index_listing_a_key_absent_from_its_shard_is_an_error(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "s.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s.safetensors",
                                                                                      "b": "s.safetensors"}}))
    with pytest.raises(CheckpointError, match="'b'"):
        SafetensorsSource(tmp_path / "model.safetensors.index.json")


def test_writer_rejects_nonpositive_shard_size(tmp_path):
    with pytest.raises(CheckpointError, match="max_shard_bytes"):
        ShardedCheckpointWriter(tmp_path / "x", max_shard_bytes=0)


@pytest.mark.parametrize("metadata", [None, {"b": "2", "a": "é 1", "mergecal_method": "x"}])
def test_streamed_shards_equal_save_files_bytes(tmp_path, metadata):
    """The writer streams each tensor to a data file and lays the shard out as safetensors does: every shard equals
    ``save_file`` of its tensors (metadata sorted) byte for byte, over every dtype, scalars and empty tensors,
    names out of order; and the whole checkpoint reads back equal."""
    from mergecal.checkpoint import _SAFETENSORS_DTYPES, _write_safetensors

    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for i, dtype in enumerate(reversed(list(_SAFETENSORS_DTYPES.values()))):
        values = torch.randn(3, 5, generator=generator) * 50
        tensors[f"z{i}.weight"] = values.to(dtype)
        tensors[f"a{i}.bias"] = values[0, 0].to(dtype).clone()  # 0-d
    tensors["empty"] = torch.zeros(0, 4)
    tensors["m.weight"] = torch.randn(7, 3, generator=generator).t()  # not contiguous
    out = save_checkpoint(tensors, tmp_path / "ckpt", max_shard_bytes=90, metadata=metadata)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    groups: dict[str, dict] = {}
    for key, shard in index["weight_map"].items():
        groups.setdefault(shard, {})[key] = tensors[key].contiguous()
    assert len(groups) > 3 and list(index["weight_map"]) == list(tensors)
    for shard, group in groups.items():
        _write_safetensors(group, tmp_path / "reference.safetensors", metadata or {}, tmp_path)
        assert (out / shard).read_bytes() == (tmp_path / "reference.safetensors").read_bytes(), shard
    assert not [p for p in out.iterdir() if p.suffix == ".data"]
    loaded = load_state_dict(out)
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())
    one = save_checkpoint(tensors, tmp_path / "one", metadata=metadata)
    _write_safetensors({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "all.safetensors", metadata or {},
                       tmp_path)
    assert (one / "model.safetensors").read_bytes() == (tmp_path / "all.safetensors").read_bytes()


def test_a_key_written_twice_is_refused_and_nothing_is_left(tmp_path):
    with pytest.raises(CheckpointError, match=r"key 'a': written twice"):
        save_checkpoint([("a", torch.ones(2)), ("b", torch.ones(2)), ("a", torch.zeros(2))], tmp_path / "ckpt",
                        max_shard_bytes=8)
    assert not list(tmp_path.iterdir())
