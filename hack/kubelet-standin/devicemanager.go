package main

import (
	_ "unsafe" // for go:linkname

	cadvisorapi "github.com/google/cadvisor/info/v1"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
)

// newDeviceManager is the upstream devicemanager's own constructor. The
// exported NewManagerImpl hard-codes the registration socket to
// /var/lib/kubelet/device-plugins/kubelet.sock (the kubelet ignores
// --root-dir there too), so we call the unexported constructor that the
// upstream tests use, which takes the socket path. Everything else -
// checkpoint file next to the socket, registration server, endpoints - is
// the untouched upstream code.
//
// The signature must match k8s.io/kubernetes v1.35.8
// pkg/kubelet/cm/devicemanager/manager.go exactly; re-check it when bumping
// K8S_VERSION in hack/k8s-build.sh (go:linkname is not type-checked).
//
//go:linkname newDeviceManager k8s.io/kubernetes/pkg/kubelet/cm/devicemanager.newManagerImpl
func newDeviceManager(logger klog.Logger, socketPath string, topology []cadvisorapi.Node, topologyAffinityStore topologymanager.Store) (*devicemanager.ManagerImpl, error)
