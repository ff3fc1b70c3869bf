"""The training lab: configured networks trained in worker processes, recorded live.

Modules: `config` (`RunConfig`, TF-free), `datasets`, `models`, `training`
(`train`, `Run`), `runner` (`RunManager`: worker processes, queue, warm
spare), `worker` (the training recipe and the worker entry point), `control`
(the pause/step/stop callback). Import what you need from them; this package
imports nothing, so `gradflow.lab.config` stays free of TensorFlow.
"""
