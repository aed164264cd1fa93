"""Experiments that showcase jaxamp: CIFAR models, data, training loop and benchmarks."""
