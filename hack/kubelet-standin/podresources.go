package main

import (
	"context"
	"fmt"
	"path/filepath"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/cri-client/pkg/util"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	podresourcesv1alpha1 "k8s.io/kubelet/pkg/apis/podresources/v1alpha1"
	apisgrpc "k8s.io/kubernetes/pkg/kubelet/apis/grpc"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	kubeletutil "k8s.io/kubernetes/pkg/kubelet/util"
)

// servePodResources is kubelet ListenAndServePodResources
// (pkg/kubelet/server): the upstream v1 and v1alpha1 servers on
// <root>/pod-resources/kubelet.sock, rate-limited like the kubelet. The
// providers are the kubelet's with the cpu, memory and DRA managers at
// their "none"/disabled behaviour.
func (s *standin) servePodResources(ctx context.Context) (*grpc.Server, error) {
	endpoint, err := kubeletutil.LocalEndpoint(filepath.Join(s.cfg.rootDir, "pod-resources"), podresources.Socket)
	if err != nil {
		return nil, err
	}
	providers := podresources.PodResourcesProviders{
		Pods:             podsProvider{s.pods},
		Devices:          devicesProvider{s.dm},
		Cpus:             noExclusiveCPUs{},
		Memory:           noMemoryManager{},
		DynamicResources: noDRA{},
	}
	server := grpc.NewServer(apisgrpc.WithRateLimiter(ctx, "podresources", podresources.DefaultQPS, podresources.DefaultBurstTokens))
	podresourcesv1alpha1.RegisterPodResourcesListerServer(server, podresources.NewV1alpha1PodResourcesServer(providers))
	podresourcesv1.RegisterPodResourcesListerServer(server, podresources.NewV1PodResourcesServer(ctx, providers))
	l, err := util.CreateListener(endpoint)
	if err != nil {
		return nil, fmt.Errorf("pod-resources listener: %w", err)
	}
	s.logger.Info("Serving the podresources API", "endpoint", endpoint)
	go func() {
		if err := server.Serve(l); err != nil {
			s.logger.Error(err, "Serving podresources")
		}
	}()
	return server, nil
}

// podsProvider is kubelet kubeletPodsProvider over our pod manager.
type podsProvider struct{ m *podManager }

func (p podsProvider) GetActivePods() []*v1.Pod { return p.m.active() }
func (p podsProvider) GetPods() []*v1.Pod       { return p.m.list(false) }
func (p podsProvider) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	return p.m.activeByName(namespace, name)
}

// devicesProvider is what containerManagerImpl provides from its device manager.
type devicesProvider struct{ dm *devicemanager.ManagerImpl }

func (d devicesProvider) UpdateAllocatedDevices() { d.dm.UpdateAllocatedDevices() }
func (d devicesProvider) GetDevices(podUID, containerName string) []*podresourcesv1.ContainerDevices {
	return containerDevicesFromResourceDeviceInstances(d.dm.GetDevices(podUID, containerName))
}
func (d devicesProvider) GetAllocatableDevices() []*podresourcesv1.ContainerDevices {
	return containerDevicesFromResourceDeviceInstances(d.dm.GetAllocatableDevices())
}

// containerDevicesFromResourceDeviceInstances lists devices the way the kubelet's
// pod-resources answers do: one entry per device ID, and a device that reports
// NUMA nodes once per NUMA node (the kubelet's own helper for this is unexported).
func containerDevicesFromResourceDeviceInstances(devs devicemanager.ResourceDeviceInstances) []*podresourcesv1.ContainerDevices {
	var out []*podresourcesv1.ContainerDevices
	for resource, byID := range devs {
		for id, dev := range byID {
			entry := func(topology *podresourcesv1.TopologyInfo) *podresourcesv1.ContainerDevices {
				return &podresourcesv1.ContainerDevices{ResourceName: resource, DeviceIds: []string{id}, Topology: topology}
			}
			numa := dev.GetTopology().GetNodes()
			if len(numa) == 0 {
				// No topology reported: still listed, without it.
				out = append(out, entry(nil))
				continue
			}
			for _, n := range numa {
				out = append(out, entry(&podresourcesv1.TopologyInfo{Nodes: []*podresourcesv1.NUMANode{{ID: n.GetID()}}}))
			}
		}
	}
	return out
}

// noExclusiveCPUs: the cpu manager with the default "none" policy.
type noExclusiveCPUs struct{}

func (noExclusiveCPUs) GetCPUs(string, string) []int64 { return []int64{} }
func (noExclusiveCPUs) GetAllocatableCPUs() []int64    { return []int64{} }

// noMemoryManager: the memory manager with the default "None" policy.
type noMemoryManager struct{}

func (noMemoryManager) GetMemory(string, string) []*podresourcesv1.ContainerMemory { return nil }
func (noMemoryManager) GetAllocatableMemory() []*podresourcesv1.ContainerMemory    { return nil }

// noDRA: no resource claims on this node.
type noDRA struct{}

func (noDRA) GetDynamicResources(*v1.Pod, *v1.Container) []*podresourcesv1.DynamicResource {
	return nil
}
