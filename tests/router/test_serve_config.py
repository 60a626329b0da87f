"""`pdserve serve --config FILE.yaml`: every flag as a key, the command line over the file."""
from __future__ import annotations

import pytest

from router.cli import cluster_config_from_args, main, parse_args


def write(tmp_path, text: str):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_file_values_become_the_flags_defaults_and_flags_win(tmp_path):
    cfg = write(tmp_path, "prefill-workers: 2\ndecode_workers: 3\nkv-cache-mib: 256\nmode: colocated\n"
                          "prefill-resource: [prefill=1]\ntransfer-timeout: 12\n")
    assert parse_args(["serve", "--config", cfg]).mode == "colocated"
    args = parse_args(["serve", "--config", cfg, "--decode-workers", "5", "--mode", "disaggregated"])
    assert (args.prefill_workers, args.decode_workers, args.kv_cache_mib) == ((2, 2), (5, 5), 256)
    assert args.mode == "disaggregated" and args.prefill_resource == ["prefill=1"]
    assert args.transfer_timeout == 12.0 and isinstance(args.transfer_timeout, float)
    cluster = cluster_config_from_args(args)
    assert cluster.prefill.resources == {"prefill": 1.0} and cluster.decode.num_workers == 5
    assert parse_args(["serve"]).prefill_workers == (1, 1)  # no file: the built-in defaults


@pytest.mark.parametrize("text, message", [
    ("prefil-workers: 2\n", "unknown key 'prefil-workers'"),
    ("mode: both\n", "mode must be one of"),
    ("prefill-workers: many\n", "prefill-workers"),
    ("- a\n- b\n", "mapping"),
])
def test_bad_files_are_refused_with_the_reason(tmp_path, capsys, text, message):
    assert main(["serve", "--config", write(tmp_path, text)]) == 2
    assert message in capsys.readouterr().err


def test_missing_file_is_an_error(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_each_role_gets_its_own_batching_knobs():
    c = cluster_config_from_args(parse_args(["serve", "--prefill-token-budget", "512", "--max-num-seqs", "8",
                                             "--decode-token-budget", "1024"]))
    assert c.prefill.scheduler.max_num_batched_tokens == 512
    assert (c.decode.scheduler.max_num_batched_tokens, c.decode.scheduler.max_num_seqs) == (1024, 8)
    c = cluster_config_from_args(parse_args(["serve", "--mode", "colocated", "--prefill-token-budget", "512",
                                             "--max-num-seqs", "8"]))
    assert (c.colocated.scheduler.max_num_batched_tokens, c.colocated.scheduler.max_num_seqs) == (512, 8)
    assert c.prefill is None and c.decode is None and list(c.pools) == ["colocated"]


def test_a_pool_takes_the_engines_cache_and_batching_unless_it_sets_its_own():
    from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig, SchedulerConfig

    engine = EngineConfig(cache=CacheConfig(block_size=8), scheduler=SchedulerConfig(max_num_seqs=4))
    own = SchedulerConfig(max_num_batched_tokens=256)
    c = ClusterConfig(engine=engine, prefill=PoolConfig(scheduler=own),
                      decode=PoolConfig(cache=CacheConfig(block_size=8, num_blocks=100)))
    assert c.engine_for(c.prefill).scheduler is own and c.engine_for(c.prefill).cache.num_blocks is None
    assert c.engine_for(c.decode).scheduler.max_num_seqs == 4 and c.engine_for(c.decode).cache.num_blocks == 100


def test_a_pool_of_the_other_mode_is_an_error():
    from pdserve.config import CacheConfig, ClusterConfig, PoolConfig

    with pytest.raises(ValueError, match="colocated pool is not part of a disaggregated cluster"):
        ClusterConfig(colocated=PoolConfig())
    with pytest.raises(ValueError, match="prefill pool is not part of a colocated cluster"):
        ClusterConfig(mode="colocated", prefill=PoolConfig())
    assert list(ClusterConfig().pools) == ["prefill", "decode"]
    with pytest.raises(ValueError, match="one KV block size"):
        ClusterConfig(decode=PoolConfig(cache=CacheConfig(block_size=32)))


def test_the_replacement_backoff_is_a_setting(tmp_path, capsys):
    """--replace-backoff FIRST:MAX (a flag or a file's key) reaches the cluster's config; a bad one is refused."""
    from pdserve.config import ClusterConfig

    assert cluster_config_from_args(parse_args(["serve"])).replace_backoff_s == (1.0, 30.0)
    assert cluster_config_from_args(parse_args(["serve", "--replace-backoff", "0.5:4"])).replace_backoff_s == (0.5, 4.0)
    cfg = write(tmp_path, "replace-backoff: 2:8\n")
    assert cluster_config_from_args(parse_args(["serve", "--config", cfg])).replace_backoff_s == (2.0, 8.0)
    for bad in ("3", "0:1", "4:2", "a:b"):
        with pytest.raises(SystemExit):
            parse_args(["serve", "--replace-backoff", bad])
        assert "backoff" in capsys.readouterr().err
    with pytest.raises(ValueError, match="replace_backoff_s"):
        ClusterConfig(replace_backoff_s=(2.0, 1.0))


def test_dtype_and_quantization_reach_every_worker(tmp_path):
    cfg = write(tmp_path, "dtype: bfloat16\nquantization: int8\n")
    engine = cluster_config_from_args(parse_args(["serve", "--config", cfg])).engine
    assert (engine.dtype, engine.quantization) == ("bfloat16", "int8")
    assert cluster_config_from_args(parse_args(["serve"])).engine.quantization is None
    with pytest.raises(SystemExit):
        parse_args(["serve", "--quantization", "int4"])


def test_the_pools_ray_demand_and_what_a_cluster_lacks():
    """At start the router compares what the pools ask Ray for with what the cluster has, and warns where it
    cannot hold them all (workers past it would wait without a word): every rank of a TP worker counts."""
    from pdserve.config import ClusterConfig, EngineConfig, PoolConfig
    from router.pools import demand, shortfall

    c = ClusterConfig(engine=EngineConfig(model="m"), prefill=PoolConfig(2, num_cpus=0.5),
                      decode=PoolConfig(10, num_cpus=0.5, resources={"decode": 1}))
    assert demand(c) == {"CPU": 6.0, "decode": 10.0}
    assert shortfall(demand(c), {"CPU": 2.0, "memory": 1e9}) == \
        "CPU: 6 asked, 2 in the cluster, decode: 10 asked, 0 in the cluster"
    assert shortfall(demand(c), {"CPU": 6.0, "decode": 12.0}) == ""
    tp = ClusterConfig(engine=EngineConfig(model="m"), prefill=PoolConfig(1, num_cpus=1, num_gpus=1),
                       decode=PoolConfig(3, num_cpus=1, num_gpus=1, tensor_parallel_size=2))
    assert demand(tp) == {"CPU": 7.0, "GPU": 7.0}
    assert shortfall(demand(tp), {"CPU": 16.0, "GPU": 4.0}) == "GPU: 7 asked, 4 in the cluster"


def test_a_simulated_worker_takes_a_sixteenth_of_a_cpu_unless_told():
    """Simulated workers sleep through their steps: by default 32 of them fit in a 2-CPU Ray cluster."""
    def cpus(*flags):
        c = cluster_config_from_args(parse_args(["serve", *flags]))
        return c.prefill.num_cpus, c.decode.num_cpus

    assert cpus("--load-format", "sim", "--model", "llama3-8b", "--dtype", "bfloat16") == (1 / 16, 1 / 16)
    assert cpus("--load-format", "sim", "--model", "llama3-8b", "--dtype", "bfloat16", "--worker-cpus", "0.25") == (0.25, 0.25)
    assert cpus() == (0.5, 0.5)
