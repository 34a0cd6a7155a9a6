"""The engines under the Communicator interface: torch.distributed, Horovod, MPI."""
