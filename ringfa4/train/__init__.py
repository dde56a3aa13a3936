"""Long-context pretraining with ring attention: FSDP2 x context parallel, configured by Hydra."""
