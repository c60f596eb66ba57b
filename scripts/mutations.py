"""Plausible bugs the test suite must catch, and a runner that proves it does (run by hand, not in CI).

Each mutation replaces one snippet of the package's source with a plausible bug, in a scratch copy of the repository,
and runs the tests named to catch it there; they must fail. The snippet must occur exactly once in its file, so that a
refactor that moves or rewrites the code is an error here, not a mutation that silently stops applying.

    python scripts/mutations.py                  # every mutation: caught, NOT CAUGHT or error, one line each
    python scripts/mutations.py ID ...           # only these
    python scripts/mutations.py --list           # the mutations, their tests, and whether each snippet still applies
    python scripts/mutations.py --baseline       # each selection on the unmutated copy: it must pass

Run it before changing or moving tests (docs/maintainers.md, "Mutations: what the suite must catch"). The copy holds
the files git tracks, and untracked ones it does not ignore (a new test not yet committed); the tests import the
package from the copy's src/ (PYTHONPATH), whatever is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = Path("src") / "lightning_ddp_amp"


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One plausible bug: ``find`` (exactly once in ``file``) becomes ``replace``; ``tests`` (pytest arguments: node
    ids, or a file with ``-k``) must then fail."""

    id: str
    bug: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]


MUTATIONS = (
    # --- apex O2's fp32 master weights ----------------------------------------------------------------------------
    Mutation(
        "o2-masters-not-saved",
        "checkpoints under apex O2 leave out the fp32 master weights, so a resume restarts them from the fp16 weights",
        "amp/apex_backend.py",
        '        if self.keeps_master_weights:\n            state["master_weights"] = self.master_weight_values()\n',
        "",
        ("tests/test_precision.py::test_o2_resume_restores_the_fp32_master_weights_not_their_fp16_copies",),
    ),
    Mutation(
        "o2-masters-built-lazily",
        "apex O2's masters are left to apex's first backward, so optimizer state restored before it lands on fp16",
        "amp/apex_backend.py",
        "            if callable(lazy_init):\n                lazy_init()\n",
        "",
        ("tests/test_precision.py::test_o2_momentum_restored_from_a_checkpoint_is_fp32_on_the_master_weights",),
    ),
    Mutation(
        "o2-as-o3-for-ddp",
        "apex O2 is taken for a level without masters: gradient_as_bucket_view=True, which its zero_grad cannot detach,"
        " passes unrefused",
        "amp/apex_backend.py",
        '    def master_weights(cls, settings: AmpSettings) -> bool:\n        return settings.opt_level == "O2"\n',
        "    def master_weights(cls, settings: AmpSettings) -> bool:\n        return False\n",
        ("tests/test_ddp_under_amp.py::test_bucket_views_asked_for_under_apex_o2_name_both_settings_and_the_fix",),
    ),
    Mutation(
        "bucket-views-under-apex",
        "DDP's gradients are bucket views under apex O0/O1/O3, which alias apex's stash of accumulated gradients",
        "ddp/wrapper.py",
        '    return getattr(plugin, "backend", None) == "apex"\n',
        '    return bool(getattr(plugin, "master_weights", False))\n',
        ("tests/test_ddp_under_amp.py", "-k", "no_bucket_views_under_apex"),
    ),
    # --- Fabric ------------------------------------------------------------------------------------------------------
    Mutation(
        "fabric-epoch-from-fabrics-count",
        "a resumed Fabric run shuffles by Fabric's own count of iterations, not the epoch the script sets",
        "fabric/strategy.py",
        "        keep_script_epoch(dataloader)\n",
        "",
        ("tests/test_fabric.py::test_the_fabric_script_ends_in_the_classic_scripts_weights[apex-O2]",),
    ),
    Mutation(
        "fabric-accumulation-unscales",
        "fabric.no_backward_sync leaves apex unscaling every micro-batch (no delay_unscale): its stash keeps the earlier"
        " micro-batches out of DDP's all-reduce",
        "fabric/strategy.py",
        "                stack.enter_context(plugin.accumulating())\n",
        "                pass\n",
        ("tests/test_fabric.py::test_the_fabric_script_ends_in_the_classic_scripts_weights[apex-O1]",),
    ),
    Mutation(
        "fabric-zero-grad-torchs",
        "Fabric's optimizer wrapper runs torch's zero_grad, not apex O2's: the fp16 model gradients accumulate",
        "fabric/strategy.py",
        "                _lightning.keep_fabric_zero_grad(optimizer)\n",
        "                pass\n",
        ("tests/test_fabric.py::test_zero_grad_of_fabrics_optimizer_is_apex_o2s",),
    ),
    Mutation(
        "fabric-clip-raises-on-overflow",
        "fabric.clip_gradients raises on the non-finite norm of a step apex skips (Fabric's error_if_nonfinite=True)",
        "fabric/strategy.py",
        "            error_if_nonfinite = False\n",
        "            pass\n",
        ("tests/test_fabric.py", "-k", "overflow_skips_the_step"),
    ),
    # --- the kwargs DDP really gets -------------------------------------------------------------------------------
    Mutation(
        "ddp-kwargs-not-passed",
        "configure_ddp wraps the model without the options the strategy computed (DDP gets torch's defaults)",
        "trainer/strategy.py",
        "        self._ddp_kwargs = self.ddp_options\n",
        "        self._ddp_kwargs = {}\n",
        ("tests/test_ddp_under_amp.py::test_native_amp_keeps_bucket_views",),
    ),
    Mutation(
        "ddp-user-kwargs-dropped",
        "DDP arguments given through **ddp_kwargs (static_graph, bucket_cap_mb, ...) never reach the wrapper",
        "ddp/wrapper.py",
        "        return {**changed, **self.extra}\n",
        "        return changed\n",
        ("tests/test_strategy.py::test_only_changed_ddp_options_are_passed_on",),
    ),
    # --- the data layout of a mid-epoch resume, and elastic padding ---------------------------------------------
    Mutation(
        "layout-check-skipped",
        "a mid-epoch position saved with another data set, seed or order is continued instead of refused",
        "trainer/position.py",
        "        if differences:\n",
        "        if False:\n",
        ("tests/test_resume.py::test_a_mid_epoch_position_in_another_layout_is_refused_naming_each_saved_value",),
    ),
    Mutation(
        "elastic-pad-from-rest",
        "the rest of a resumed epoch is padded with its own first samples, not the epoch's as DistributedSampler pads",
        "trainer/samplers.py",
        "        rest += order[: num_replicas - len(rest) % num_replicas]\n",
        "        rest += rest[: num_replicas - len(rest) % num_replicas]\n",
        (
            "tests/test_resume.py::"
            "test_a_position_saved_on_two_ranks_continues_on_any_number_with_each_remaining_sample_once",
        ),
    ),
    # --- atomic checkpoint writes -----------------------------------------------------------------------------
    Mutation(
        "checkpoint-written-in-place",
        "the checkpoint is written straight over the target: a save that fails halfway destroys the previous one",
        "trainer/resume.py",
        '        temporary = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")\n'
        "        # Created as open() creates files, 0o666 less the umask (tempfile.mkstemp would give 0o600).\n"
        '        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)\n',
        "        temporary = target\n"
        '        handle = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o666)\n',
        ("tests/test_resume.py::test_a_save_that_fails_halfway_leaves_the_previous_checkpoint_as_it_was",),
    ),
    Mutation(
        "checkpoint-not-fsynced",
        "the os.fsync before the rename is gone: a power loss after it can leave an empty file under the name",
        "trainer/resume.py",
        "                file.flush()\n                os.fsync(file.fileno())\n",
        "                file.flush()\n",
        ("tests/test_resume.py::test_the_whole_checkpoint_reaches_the_disk_before_it_is_renamed_into_place",),
    ),
    # --- exit statuses ----------------------------------------------------------------------------------------
    Mutation(
        "preempted-rank-exits-0",
        "a rank that saved on SIGTERM raises Lightning's SIGTERMException bare, so it exits 0 instead of 143",
        "trainer/resume.py",
        "            raise SIGTERMException(128 + signum)\n",
        "            raise SIGTERMException()\n",
        ("tests/test_resume.py::test_a_sigterm_during_training_saves_a_checkpoint_and_exits_128_plus_the_signal",),
    ),
    Mutation(
        "agent-exit-is-a-failed-fit",
        "the agent of a self-launch leaves fit with the Trainer's callbacks and loggers attached, which Lightning hands"
        " its exit as a failed run: OnExceptionCheckpoint saves the untrained model beside the ranks' checkpoints",
        "ddp/launcher.py",
        "            trainer.callbacks = []\n            trainer.loggers = []\n",
        "            pass\n",
        ("tests/test_strategy.py::test_the_agent_leaves_the_trainers_callbacks_and_loggers_to_the_ranks",),
    ),
    Mutation(
        "agent-checks-the-precision-plugin",
        "the process that will start the ranks checks the precision plugin too, and says its choice before rank 0 does",
        "_lightning/connectors.py",
        "        if isinstance(plugin, precision_class) and not supervises:\n",
        "        if isinstance(plugin, precision_class):\n",
        ("tests/test_selflaunch.py::test_the_agent_of_a_self_launch_prints_only_what_it_does",),
    ),
    Mutation(
        "selflaunch-signal-status",
        "a self-launch whose rank was killed by a signal exits with torchrun's negative code (-9: 247), not 137",
        "launch/selflaunch.py",
        "        status = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode\n",
        "        status = failure.exitcode\n",
        ("tests/test_selflaunch.py::test_a_rank_killed_by_a_signal_makes_the_self_launch_exit_128_plus_the_signal",),
    ),
    # --- compare: its verdict and the first-batch check -------------------------------------------------------
    Mutation(
        "compare-apart-exits-0",
        "compare exits 0 when a candidate is apart and none failed",
        "commands/compare/report.py",
        "    return 1 if statuses & {APART, FAILED} else 0\n",
        "    return 1 if FAILED in statuses else 0\n",
        ("tests/test_compare.py::test_a_one_process_compare_whose_only_problem_is_a_candidate_apart_exits_1",),
    ),
    Mutation(
        "compare-loss-tolerance-flipped",
        "the final loss is apart when it is within the tolerance, and close beyond it",
        "commands/compare/verdict.py",
        "    if not _within(final, tolerance.loss):\n",
        "    if _within(final, tolerance.loss):\n",
        ("tests/test_compare.py::test_a_candidate_is_apart_beyond_either_tolerance_and_close_within_both",),
    ),
    Mutation(
        "compare-percent-tolerance-unscaled",
        "--metric val_acc:1% is read as a tolerance of 100% (1.0), so any candidate's metric passes",
        "commands/compare/tolerance.py",
        '            value = float(tolerance[:-1]) / 100 if tolerance.endswith("%") else float(tolerance)\n',
        '            value = float(tolerance[:-1]) if tolerance.endswith("%") else float(tolerance)\n',
        ("tests/test_compare.py::test_a_metric_tolerance_ending_in_percent_is_relative_and_a_number_absolute",),
    ),
    Mutation(
        "compare-batch-hash-unchecked",
        "runs whose first training batch differs are compared anyway (the report reads a key the record lacks)",
        "commands/compare/comparable.py",
        '            if ours["batch_hash"] != theirs["batch_hash"]:\n',
        '            if ours.get("batch") != theirs.get("batch"):\n',
        ("tests/test_compare.py::test_runs_that_did_not_start_alike_are_not_compared_and_the_problem_names_the_fix",),
    ),
    Mutation(
        "recording-empty-batch-hash",
        "the recording writes the hash of nothing as the first batch's, so every run seems to start alike",
        "commands/compare/tensors.py",
        "    return hash_tensors(dict(enumerate(_tensors(batch))))\n",
        "    return hash_tensors({})\n",
        ("tests/test_compare.py::test_each_record_holds_the_hash_of_the_first_batch_its_run_trained",),
    ),
    Mutation(
        "recording-empty-weights-hash",
        "the recording writes the hash of nothing as the starting weights', so unseeded runs seem to start alike",
        "commands/compare/recorder.py",
        "        self._module_hashes.append(hash_tensors(state))\n",
        "        self._module_hashes.append(hash_tensors({}))\n",
        ("tests/test_compare.py::test_each_record_holds_the_hash_of_the_weights_its_run_started_from",),
    ),
    # --- reduce: what sync_dist logging gets back -------------------------------------------------------------
    Mutation(
        "reduce-integer-mean-float64",
        "the mean of an integer tensor is float64, which apex O1 refuses to divide a float32 sum by",
        "launch/process_group.py",
        "    return total.to(torch.get_default_dtype()) / dist.get_world_size(group)\n",
        "    return total.to(torch.float64) / dist.get_world_size(group)\n",
        ("tests/test_strategy.py::test_reduce_keeps_floats_in_their_dtype_and_averages_integers_in_the_default_one",),
    ),
    Mutation(
        "reduce-float32-mean-float64",
        "float tensors are reduced in float64 for accuracy and come back float64",
        "trainer/strategy.py",
        "        return super().reduce(tensor, group, reduce_op)\n",
        "        return super().reduce(tensor.double() if isinstance(tensor, Tensor) else tensor, group, reduce_op)\n",
        ("tests/test_strategy.py::test_reduce_keeps_floats_in_their_dtype_and_averages_integers_in_the_default_one",),
    ),
    # --- more plausible bugs ----------------------------------------------------------------------------------
    Mutation(
        "local-rank-from-rank",
        "LOCAL_RANK is read from RANK: on the second node every rank is out of range or on the wrong GPU",
        "launch/environment.py",
        '    local_rank = read_int(env, "LOCAL_RANK", minimum=0, below=below)\n',
        '    local_rank = read_int(env, "RANK", minimum=0, below=below)\n',
        ("tests/test_environment.py::test_second_node_of_a_two_node_torchrun_job",),
    ),
    Mutation(
        "group-timeout-ignored",
        "the process group gets torch's 30-minute timeout, not EnvDDPStrategy(timeout=...): a hung peer hangs the job",
        "launch/process_group.py",
        "world_size=topology.world_size, timeout=timeout, **binding\n",
        "world_size=topology.world_size, **binding\n",
        ("tests/test_strategy.py::test_the_process_group_and_its_store_get_the_strategys_timeout",),
    ),
    Mutation(
        "evaluation-initializes-apex",
        "trainer.validate after trainer.fit calls amp.initialize again, which apex allows once per process",
        "trainer/precision.py",
        "        if not optimizers or _trainer_fn(model) not in (None, TrainerFn.FITTING):\n",
        "        if not optimizers:\n",
        (
            "tests/test_precision.py::"
            "test_evaluation_after_fit_runs_the_amp_initialized_model_without_initializing_again",
        ),
    ),
    Mutation(
        "native-clips-scaled-gradients",
        "native AMP does not unscale before the clipping and the before-step hooks, which see gradients x65536",
        "trainer/precision.py",
        "        self.amp_backend.unscale(optimizer)\n        _lightning.after_closure(self, model, optimizer)\n",
        "        _lightning.after_closure(self, model, optimizer)\n",
        ("tests/test_precision.py::test_native_gradient_clipping_clips_the_unscaled_gradients",),
    ),
    Mutation(
        "resumed-epoch-not-set",
        "a run resumed from the end of an epoch reads its next epoch in the finished epoch's order",
        "trainer/position.py",
        "            if self._sampler is not None:\n                self._sampler.set_epoch(epoch + 1)\n",
        "",
        ("tests/test_resume.py::test_an_end_of_epoch_position_resumes_in_any_layout",),
    ),
    Mutation(
        "split-batches-not-split",
        "split_batches gives every rank the whole global batch: each step trains world-size times the batch",
        "trainer/sharding.py",
        "    return global_batch // num_replicas\n",
        "    return global_batch\n",
        ("tests/test_data.py::test_split_batches_divides_the_global_batch",),
    ),
    # --- a classic apex checkpoint continued under Lightning --------------------------------------------------------
    Mutation(
        "classic-optimizer-state-dropped",
        "the converted checkpoint leaves out the classic optimizer's state: Adam restarts its moments",
        "commands/convert.py",
        '        "optimizer_states": _listed(classic, OPTIMIZER_KEYS),\n',
        '        "optimizer_states": [{"state": {}, "param_groups": _listed(classic, OPTIMIZER_KEYS)[0]["param_groups"]}],\n',
        ("tests/test_migrate.py::test_a_continued_classic_checkpoint_ends_in_the_uninterrupted_runs_weights",),
    ),
    Mutation(
        "classic-step-not-carried",
        "the converted checkpoint continues at the right epoch but counts its optimizer steps from 0",
        "_lightning/loops.py",
        '    optimizer["step"]["total"].update(ready=global_step, completed=global_step)\n',
        "",
        ("tests/test_migrate.py", "-k", "carried"),
    ),
    # --- compare: the evidence to leave apex ------------------------------------------------------------------------
    Mutation(
        "overflow-rerun-keeps-its-statistics",
        "training an overflowing step again leaves its batchnorm statistics behind: the run under compare changes",
        "commands/compare/overflow.py",
        "        setattr(owner, name, buffer.detach().clone())\n",
        "        pass\n",
        ("tests/test_overflow.py", "-k", "changes_no_weight"),
    ),
    Mutation(
        "overflow-names-the-container",
        "the overflow locator names the last module to finish (the container) instead of the innermost one",
        "commands/compare/overflow.py",
        "                if self.forward is None and not bool(torch.isfinite(tensor).all()):\n",
        "                if not bool(torch.isfinite(tensor).all()):\n",
        ("tests/test_overflow.py", "-k", "forward_overflow"),
    ),
    Mutation(
        "noise-floor-not-perturbed",
        "the noise-floor run repeats the baseline bit for bit: a floor of 0 that says nothing",
        "commands/compare/recorder.py",
        "        if self.plan.perturb:\n            one_ulp_up(module)\n",
        "",
        ("tests/test_compare.py", "-k", "noise_floor_run"),
    ),
    Mutation(
        "metrics-from-training-too",
        "a validation run's record also holds what training logged",
        "_lightning/loops.py",
        '    values = results.metrics(on_step=False)["callback"]\n',
        "    values = trainer.callback_metrics\n",
        ("tests/test_lightning_internals.py", "-k", "evaluation_metrics"),
    ),
    # --- apex O1 on today's torch: RNNs --------------------------------------------------------------------------
    Mutation(
        "rnn-input-left-fp16",
        "an RNN fed O1's fp16 activations keeps them, and torch's dtype check refuses them before apex's cast",
        "amp/apex_o1.py",
        "        return (given.to(weight.dtype), *args[1:]), kwargs\n",
        "        return None\n",
        ("tests/test_apex_reference.py", "-k", "rnn"),
    ),
    Mutation(
        "nn-rnn-cast-not-restored",
        "nn.RNN stays past apex's cast (today's forward calls _VF.rnn_tanh directly) and computes in fp32",
        "amp/apex_o1.py",
        "            amp.wrap.new_rnn_cast(name, amp._amp_state.handle)\n",
        "            pass\n",
        ("tests/test_apex_reference.py", "-k", "rnn"),
    ),
    # --- Fabric: loss ids, the accumulation switches, several models, a one-rank group the script started --------
    Mutation(
        "fabric-loss-id-dropped",
        "fabric.backward(loss, loss_id=1) scales with loss 0's scaler: an overflow of loss 1 halves the other's scale",
        "fabric/precision.py",
        "        self.amp_backend.backward(tensor, chosen, run_backward, loss_id, delay_unscale)\n",
        "        self.amp_backend.backward(tensor, chosen, run_backward, 0, delay_unscale)\n",
        ("tests/test_fabric.py::test_an_overflow_of_the_second_loss_halves_its_own_loss_scale_only",),
    ),
    Mutation(
        "fabric-no-sync-enabled-ignored",
        "fabric.no_backward_sync(model, enabled=False) still delays apex's unscale: the micro-batch that steps keeps"
        " gradients x65536",
        "fabric/strategy.py",
        "        if not enabled:\n            yield\n            return\n",
        "",
        (
            "tests/test_fabric.py::"
            "test_a_backward_in_no_backward_sync_disabled_leaves_the_gradients_unscaled_as_one_outside_it",
        ),
    ),
    Mutation(
        "fabric-native-o3-converts-newest-only",
        "native O3 converts only the newest model of setup_models: the earlier ones lose their input casts",
        "fabric/precision.py",
        "            self.amp_backend.convert_module(ModuleList(self._converted), list(self._converted))\n",
        "            self.amp_backend.convert_module(ModuleList([module]), [module])\n",
        ("tests/test_fabric.py::test_native_o3_setup_models_casts_every_model_and_each_runs_its_forward",),
    ),
    Mutation(
        "fabric-script-group-said-missing",
        "a one-rank job whose script started its own group is told '1 rank, ..., so no process group' beside it",
        "ddp/reconciler.py",
        '        if not started_by_script() and topology.launcher != "none":\n',
        '        if topology.launcher != "none":\n',
        ("tests/test_fabric.py::test_a_one_rank_group_the_script_started_is_trained_on_without_saying_there_is_none",),
    ),
    Mutation(
        "fabric-explicit-delay-unscale-ignored",
        "fabric.backward(loss, delay_unscale=True) outside no_backward_sync unscales anyway (only the context counts)",
        "fabric/precision.py",
        "        if delay_unscale is None:\n            delay_unscale = self._accumulating > 0\n",
        "        delay_unscale = self._accumulating > 0\n",
        ("tests/test_fabric.py::test_an_explicit_delay_unscale_keeps_the_gradients_scaled_outside_no_backward_sync",),
    ),
    # --- scripts shaped like apex's own examples: a GAN, one process, ranks that start apart ----------------------
    Mutation(
        "every-optimizer-for-every-loss",
        "a loss is scaled for every optimizer set up (the old 'safe superset'): the discriminator's overflow skips the"
        " generator's next step too",
        "amp/loss_optimizers.py",
        "        if len(self.optimizers) <= 1:\n            return list(self.optimizers)\n",
        "        if True:\n            return list(self.optimizers)\n",
        (
            "tests/test_loss_optimizers.py",
            "-k",
            "discriminator_loss or several_optimizers or asks_the_same",
        ),
    ),
    Mutation(
        "fabric-one-process-sampler-swapped",
        "Fabric's envddp in one process swaps the script's RandomSampler for a DistributedSampler(num_replicas=1, seed=0),"
        " which ignores the script's seed",
        "fabric/strategy.py",
        "        if not self.topology.is_distributed:\n            return None\n",
        "",
        (
            "tests/test_loss_optimizers.py::test_fabric_one_process_keeps_the_scripts_shuffle",
            "tests/test_fabric.py::test_the_fabric_script_in_one_process_ends_in_the_classic_scripts_weights",
        ),
    ),
    Mutation(
        "lightnings-unused-parameters-advice",
        "DDP's unused-parameter error keeps Lightning's advice, ddp_find_unused_parameters_true, where apex cannot run",
        "trainer/strategy.py",
        "        explain_unused_parameters(exception, self._ddp_kwargs)\n",
        "",
        (
            "tests/test_loss_optimizers.py::test_ddps_unused_parameter_error_names_envddps_setting",
            "tests/test_gan_reference.py::test_the_trainer_door_without_the_unused_parameter_search_names_envddps_setting",
        ),
    ),
    Mutation(
        "o2-masters-from-this-ranks-weights",
        "apex O2's fp32 masters keep the weights this rank started from, not rank 0's that the DDP wrap gave it",
        "amp/apex_backend.py",
        "        for model_param, master in self.master_weight_pairs():\n            master.data.copy_(model_param.data)\n",
        "        return\n",
        (
            "tests/test_apex_reference.py",
            "tests/test_gan_reference.py",
            "-k",
            "envddp_ends_in_the_references_state and apex_o2 or every_parameter_on_every_rank and 2-ranks-O2",
        ),
    ),
    # --- compare on a kept Fabric loop --------------------------------------------------------------------------------
    Mutation(
        "fabric-run-not-ended-at-its-steps",
        "a compared Fabric loop runs past --steps: every run trains the script's whole length",
        "commands/compare/fabric_recording.py",
        "        if done >= self._last_step:\n",
        "        if False:\n",
        ("tests/test_compare_fabric.py", "-k", "ends_cleanly_after_its_steps"),
    ),
    Mutation(
        "fabric-model-calls-not-watched",
        "a kept loop's overflow is never located: the models' calls are not kept for the re-run",
        "commands/compare/fabric_recording.py",
        "        self._watching.append(self._calls.watch(module))",
        "        self._watching.append(self._calls.watch(torch.nn.Identity()))",
        ("tests/test_compare_fabric_runs.py::test_the_injected_overflow_is_located_in_the_example_on_every_amp_run",),
    ),
    Mutation(
        "fabric-save-not-redirected",
        "a compared Fabric loop's fabric.save writes where the script says: the runs overwrite each other's checkpoint",
        "commands/compare/run_files.py",
        "        return save(copy, *args, **kwargs)\n",
        "        return save(path, *args, **kwargs)\n",
        ("tests/test_compare_fabric.py", "-k", "fabric_save_writes or a_load_reads"),
    ),
    Mutation(
        "fabric-load-ignores-the-runs-copy",
        "fabric.load reads the script's path, never the run's copy: a run resumes another run's checkpoint",
        "commands/compare/run_files.py",
        "        return copy if copy is not None and os.path.exists(copy) else path\n",
        "        return path\n",
        ("tests/test_compare_fabric.py", "-k", "fabric_save_writes or a_load_reads"),
    ),
    Mutation(
        "fabric-loggers-not-redirected",
        "a compared Fabric loop's loggers write into the script's folders, every run into the same ones",
        "commands/compare/run_files.py",
        "    if script_loggers is None:\n",
        "    if True:\n",
        ("tests/test_compare_fabric.py", "-k", "loggers"),
    ),
    Mutation(
        "fabric-grad-norm-scaled",
        "a kept loop's gradient norm under a loss scaler is measured before the step unscales: 65536 times too large",
        "commands/compare/fabric_recording.py",
        '                self._plugin.unscale_gradients(getattr(optimizer, "optimizer", optimizer))\n',
        "                pass\n",
        ("tests/test_compare_fabric.py", "-k", "unscaled"),
    ),
    Mutation(
        "fabric-fused-optimizer-norm-crashes",
        "a kept loop with a fused optimizer under Lightning's 16-mixed crashes at the first measured gradient norm",
        "commands/compare/fabric_recording.py",
        "            except NotImplementedError:\n",
        "            except ValueError:\n",
        ("tests/test_compare_fabric.py", "-k", "fused_step"),
    ),
    Mutation(
        "grad-norm-at-every-step",
        "the gradient norm is measured at every step whatever --grad-norm-every says: its cost comes back",
        "commands/compare/recorder.py",
        "        return step % self._norm_every == 0\n",
        "        return True\n",
        ("tests/test_compare_fabric.py", "-k", "every_nth_step"),
    ),
    Mutation(
        "skipped-step-not-located",
        "a step the loss scaler skipped on a finite loss is never located: the common fp16 backward overflow",
        "commands/compare/recording.py",
        "            check = self._batch is not None\n",
        "            check = False\n",
        ("tests/test_compare.py", "-k", "skips_on_a_finite_loss"),
    ),
    Mutation(
        "fabric-skipped-step-not-located",
        "a kept loop's step that the loss scaler skipped on a finite loss is never located",
        "commands/compare/fabric_recording.py",
        "        if recorder.after_step(index, optimizer, opened, check=check):\n",
        "        if recorder.after_step(index, optimizer, opened, check=False):\n",
        ("tests/test_compare_fabric.py", "-k", "skips_on_a_finite_loss"),
    ),
    Mutation(
        "fabric-random-draws-never-seen",
        "a kept loop's model that draws random numbers (dropout) is taken for one that draws none: its random state"
        " is no longer kept and an overflow its mask decides is re-run with another mask",
        "commands/compare/model_calls.py",
        "        if drew(before, self.device):\n",
        "        if False:\n",
        ("tests/test_overflow.py", "-k", "random_state"),
    ),
    Mutation(
        "fabric-late-draws-not-said",
        "a kept loop's model that starts drawing random numbers after its checked calls is re-run from another random"
        " state and the located place is reported as sure",
        "commands/compare/overflow.py",
        "    if before is not None and call not in unkept and model_calls.drew(before, call.device):\n",
        "    if False:\n",
        ("tests/test_overflow.py", "-k", "starts_drawing"),
    ),
    Mutation(
        "callback-hooks-not-silenced",
        "the recording's unused per-batch callback hooks are still called, each through the profiler, at every step",
        "_lightning/members.py",
        "    return dict.fromkeys(names)\n",
        "    return {}\n",
        ("tests/test_lightning_internals.py", "-k", "silenced"),
    ),
    Mutation(
        "grad-norm-float32-only",
        "the gradient norm leaves out the gradients that are not contiguous float32 (bfloat16 weights, a transposed one)",
        "commands/compare/recorder.py",
        "            else torch.linalg.vector_norm(grad, dtype=torch.float32).square()\n",
        "            else torch.zeros((), device=grad.device)\n",
        ("tests/test_compare.py", "-k", "whatever_its_dtype_or_layout"),
    ),
    Mutation(
        "broken-weights-re-run",
        "weights already NaN as a step starts are re-run and blamed on the first module's forward",
        "commands/compare/overflow.py",
        "            if parameter.is_floating_point() and not bool(torch.isfinite(parameter).all()):\n",
        "            if False:\n",
        ("tests/test_overflow.py", "-k", "weights_already"),
    ),
    Mutation(
        "fabric-o2-weights-not-masters",
        "a kept loop under apex O2 compares its fp16 weights, not the fp32 masters the optimizer steps",
        "commands/compare/recorder.py",
        '    pairs = plugin.amp_backend.master_weight_pairs() if hasattr(plugin, "amp_backend") else []\n',
        "    pairs: list[tuple[Tensor, Tensor]] = []\n",
        ("tests/test_compare_fabric.py", "-k", "masters"),
    ),
    Mutation(
        "loss-id-apart-not-checked",
        "a run whose loss_id 2 trains apart is called close because the sum of its losses is",
        "commands/compare/verdict.py",
        '        elif not _within(loss["final_loss_relative_difference"], tolerance.loss):\n',
        "        elif False:\n",
        ("tests/test_compare.py::test_a_loss_id_apart_makes_the_run_apart_though_the_sum_of_the_losses_is_close",),
    ),
    Mutation(
        "identical-ignores-loss-ids",
        "a run is called identical when the sum of its losses matches though one loss_id's does not",
        "commands/compare/verdict.py",
        '        or not all(_same(losses, base["loss_by_id"][loss_id]) for loss_id, losses in series["loss_by_id"].items())\n',
        "",
        ("tests/test_compare.py::test_identical_needs_each_loss_id_at_each_step_not_only_their_sum",),
    ),
    # --- the AMP options, declared once ------------------------------------------------------------------------------
    Mutation(
        "carried-options-lose-the-loss-scale",
        "compare carries a script's AmpPrecision to another level without its loss scale",
        "amp/settings.py",
        'for f in fields if f.name != "opt_level"}',
        'for f in fields if f.name not in ("opt_level", "loss_scale")}',
        ("tests/test_settings.py::test_settings_run_again_at_another_level_with_every_option_as_given",),
    ),
    Mutation(
        "misspelt-option-passes",
        "a misspelt AmpPrecision option reaches the dataclass, which fails with Python's TypeError naming no option",
        "amp/settings.py",
        "        if name not in names:\n",
        "        if False:\n",
        ("tests/test_settings.py", "-k", "misspelt"),
    ),
    # --- the first hour: what a new user meets -----------------------------------------------------------------
    Mutation(
        "model-summary-names-16-mixed",
        "under AmpPrecision Lightning's model summary warns about '16-mixed', a precision the script never asked for",
        "trainer/precision.py",
        "        warnings.filterwarnings(\n"
        '            "ignore", message=rf"Precision {re.escape(str(self.precision))} is not supported by the model summary"\n'
        "        )\n",
        "",
        ("tests/test_everyday.py", "-k", "no_warning_of_the_fit"),
    ),
    Mutation(
        "converted-epoch-as-last-trained",
        "convert_apex_checkpoint reads 'epoch' as the epoch last trained (one more done): the fit skips an epoch the"
        " classic resume trains",
        "commands/convert.py",
        '    done, epoch_from = _count(classic, "epoch", ("epoch",), epoch)\n',
        '    done, epoch_from = _count(classic, "epoch", ("epoch",), epoch)\n    done += epoch is None and "epoch" in classic\n',
        (
            "tests/test_migrate.py::test_the_classic_examples_checkpoint_continues_under_the_trainer_with_the_epochs_its_own_resume_trains",
        ),
    ),
    Mutation(
        "converted-apex-state-without-amp",
        "a classic checkpoint without amp.state_dict() still gets an apex state, and its resume names apex",
        "commands/convert.py",
        '    if "amp" in classic or level in ("O2", "O3"):\n',
        "    if True:\n",
        ("tests/test_migrate.py::test_without_an_amp_state_no_apex_state_is_written_and_the_report_names_no_backend",),
    ),
)


def source_with(mutation: Mutation, root: Path) -> str:
    """The mutated text of ``mutation.file`` under ``root``.

    Raises:
        ValueError: The snippet is not in the file exactly once.
    """
    path = root / PACKAGE / mutation.file
    text = path.read_text()
    count = text.count(mutation.find)
    if count != 1:
        raise ValueError(
            f"{mutation.id}: its snippet occurs {count} times in {PACKAGE / mutation.file}, not once: the code moved or"
            " changed; update the snippet in scripts/mutations.py (and check the tests named still catch the bug)"
        )
    return text.replace(mutation.find, mutation.replace)


def repository_files() -> list[str]:
    """What git tracks, and the untracked files it does not ignore (a new test not yet committed)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and (REPO / name).is_file()})


@contextmanager
def scratch_copy(files: Sequence[str]) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="mutation-") as directory:
        root = Path(directory)
        for name in files:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
        yield root


@dataclasses.dataclass
class Outcome:
    returncode: int | None  # None: the tests ran past the timeout
    seconds: float
    output: str  # pytest's, stdout and stderr merged


def run_tests(root: Path, python: str, tests: Sequence[str], timeout: float) -> Outcome:
    """``python -m pytest -x`` on ``tests`` in ``root``, the package imported from ``root/src``.

    Raises:
        SystemExit: ``python`` would import the package from elsewhere (no mutation could then be caught).
    """
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root / "src")
    where = subprocess.run(
        [python, "-c", "import importlib.util; print(importlib.util.find_spec('lightning_ddp_amp').origin)"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not where.startswith(str(root)):
        raise SystemExit(f"{python} imports lightning_ddp_amp from {where or 'nowhere'}, not from the copy's src/")
    started = time.monotonic()
    process = subprocess.Popen(
        [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so that a timeout also ends the ranks and servers the tests started
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        returncode = None
    return Outcome(returncode, time.monotonic() - started, output)


def verdict(outcome: Outcome, baseline: bool) -> str:
    """``caught`` (or ``passes`` for a baseline), ``NOT CAUGHT`` (``FAILS``), or ``error`` with what went wrong."""
    if outcome.returncode is None:
        return "error (timeout)"
    if baseline:
        return {0: "passes", 1: "FAILS"}.get(outcome.returncode, f"error (pytest exit {outcome.returncode})")
    # 1: a test failed. 0: they all passed. 2-5: interrupted, internal or usage error, nothing collected.
    return {1: "caught", 0: "NOT CAUGHT"}.get(outcome.returncode, f"error (pytest exit {outcome.returncode})")


def list_mutations(mutations: Sequence[Mutation]) -> int:
    problems = 0
    for mutation in mutations:
        try:
            source_with(mutation, REPO)
            applies = "applies"
        except ValueError as error:
            applies, problems = f"ERROR: {error}", problems + 1
        print(f"{mutation.id}  ({PACKAGE / mutation.file}; {applies})\n    {mutation.bug}")
        print("".join(f"    test: {test}\n" for test in mutation.tests), end="")
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", metavar="ID", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and whether each snippet applies")
    parser.add_argument("--baseline", action="store_true", help="run each selection unmutated; it must pass")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to test with (default: this one)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutation (default: 900)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's output after each line")
    args = parser.parse_args(argv)

    known = {mutation.id: mutation for mutation in MUTATIONS}
    unknown = [name for name in args.ids if name not in known]
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; --list shows them")
    chosen = [known[name] for name in args.ids] if args.ids else list(MUTATIONS)
    if args.list:
        return list_mutations(chosen)

    files = repository_files()
    width = max(len(mutation.id) for mutation in chosen)
    failed: list[str] = []
    started = time.monotonic()
    for mutation in chosen:
        with scratch_copy(files) as root:
            try:
                mutated = source_with(mutation, root)
            except ValueError as error:
                print(f"{'error':<12} {mutation.id:<{width}}     -   {error}", flush=True)
                failed.append(mutation.id)
                continue
            if not args.baseline:
                (root / PACKAGE / mutation.file).write_text(mutated)
            outcome = run_tests(root, args.python, mutation.tests, args.timeout)
        result = verdict(outcome, args.baseline)
        print(f"{result:<12} {mutation.id:<{width}} {outcome.seconds:6.1f}s  {' '.join(mutation.tests)}", flush=True)
        if args.verbose:
            print(outcome.output, flush=True)
        if result not in ("caught", "passes"):
            failed.append(mutation.id)
            if not args.verbose:
                print(outcome.output[-3000:], flush=True)
    what = "unmutated selections" if args.baseline else "mutations"
    print(f"{len(chosen) - len(failed)} of {len(chosen)} {what} as expected in {time.monotonic() - started:.0f}s")
    if failed:
        print(f"not as expected: {' '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
