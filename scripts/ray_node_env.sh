# Sourced by scripts/ray_head.sh and scripts/ray_worker.sh: the cluster network settings of docker-compose.yml
# (DAS_NODE_IP, DAS_NCCL_SOCKET_IFNAME, DAS_NCCL_IB_HCA) as Ray and NCCL read them. Unset or empty ones are left
# out, so Ray and NCCL keep their own choice (an empty NCCL_SOCKET_IFNAME would not mean "any").
ray_node_flags=()
if [ -n "${DAS_NODE_IP:-}" ]; then
  ray_node_flags+=("--node-ip-address=$DAS_NODE_IP")
fi
if [ -n "${DAS_NCCL_SOCKET_IFNAME:-}" ]; then
  # Every process Ray starts on this node inherits these: FSDP's NCCL and Gloo groups, vLLM's workers.
  export NCCL_SOCKET_IFNAME="$DAS_NCCL_SOCKET_IFNAME" GLOO_SOCKET_IFNAME="$DAS_NCCL_SOCKET_IFNAME"
fi
if [ -n "${DAS_NCCL_IB_HCA:-}" ]; then
  export NCCL_IB_HCA="$DAS_NCCL_IB_HCA"
fi
