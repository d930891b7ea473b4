"""The algorithm on explicit tensors (Algs. 1-4): advantages, losses, the batch, the actor's
update, the methods, the FFN-channel perturbation, and the deployment perturbations of App. C."""
