"""Checkpoints: conversion between Hugging Face Llama and Megatron-Core distributed checkpoints."""
