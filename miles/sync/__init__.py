"""Weight sync: prepare full engine-named tensors, bucket them, hand buckets to a transport."""
