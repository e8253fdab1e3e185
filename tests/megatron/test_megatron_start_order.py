"""Start-up order of the Megatron Ray policy actor (cluster review 2, N10): a hub id is downloaded before
the default process group is initialised, so no communicator (and no NCCL watchdog) is live while a node
fetches the weights. The real ``init_model_from_pretrained`` runs with the hub download, the process-group
init and the actor's construction replaced by recorders."""

from types import SimpleNamespace as NS

import pytest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from openrlhf_lpo.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("order") / "q3", arch="qwen3", hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


class _Stop(Exception):
    pass


def test_the_hub_model_is_downloaded_before_the_process_group(tiny_dir, monkeypatch):
    import huggingface_hub
    import torch.distributed as dist
    from huggingface_hub import constants

    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
    from openrlhf_lpo.megatron import actor as actor_module
    from openrlhf_lpo.megatron.device import default_backend
    from openrlhf_lpo.megatron.ray_actor import MegatronPolicyActor

    args = build_parser_and_parse([
        "--actor.model_name_or_path", tiny_dir, "--reward.remote_url", "http://127.0.0.1:1/reward",
        "--data.prompt_dataset", "unused", "--actor.num_gpus_per_node", "2", "--backend", "megatron",
        "--megatron.tp", "2", "--rollout.n_samples_per_prompt", "2", "--algo.advantage.estimator", "group_norm",
        "--train.batch_size", "8", "--rollout.batch_size", "4", "--train.micro_batch_size", "2",
        "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0"])
    calls = []

    def snapshot_download(repo_id, local_files_only=False, **kw):
        if local_files_only:  # not in the cache: the first start from a hub id
            calls.append("cache lookup")
            raise FileNotFoundError("not cached")
        calls.append(f"download {repo_id}")
        return tiny_dir

    def init_process_group(backend=None, **kw):
        calls.append(f"init_process_group {backend}")

    def megatron_actor(hf_config, cfg, hf_weights=None):
        calls.append(f"MegatronActor {hf_weights}")
        raise _Stop

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(actor_module, "MegatronActor", megatron_actor)
    assert not dist.is_initialized()
    with pytest.raises(_Stop):
        MegatronPolicyActor().init_model_from_pretrained(NS(args=args), "acme/tiny", max_steps=4)
    assert calls == ["cache lookup", "download acme/tiny", f"init_process_group {default_backend()}",
                     f"MegatronActor {tiny_dir}"]
