"""Policy weights, trainer -> inference: broadcast folders on the filesystem, or a torch.distributed
collective (announcement, manifest, the shared endpoint, sender and receiver)."""
