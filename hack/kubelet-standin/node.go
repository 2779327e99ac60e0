package main

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/component-base/version"
	nodeutil "k8s.io/component-helpers/node/util"
	v1helper "k8s.io/kubernetes/pkg/apis/core/v1/helper"
)

// kubeletVersion reports the Kubernetes version this binary was built from
// (hack/k8s-build.sh stamps it like upstream release builds).
func kubeletVersion() string {
	if v := version.Get().GitVersion; strings.HasPrefix(v, "v1.") {
		return v
	}
	return "v0.0.0-standin"
}

// ownLabels are the labels this kubelet sets on its Node; everything else on
// the Node's metadata belongs to others (e.g. the nano-gpu agent).
func (s *standin) ownLabels() map[string]string {
	return map[string]string{
		v1.LabelHostname:   s.cfg.nodeName,
		v1.LabelOSStable:   runtime.GOOS,
		v1.LabelArchStable: runtime.GOARCH,
	}
}

// registerNode is kubelet registerWithAPIServer: create the Node, or adopt
// the existing one, setting only our own labels.
func (s *standin) registerNode(ctx context.Context, resetExtended bool) error {
	return wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: s.cfg.nodeName, Labels: s.ownLabels()}}
		s.setNodeStatus(node, nil, nil, time.Now())
		_, err := s.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
		if err == nil {
			s.logger.Info("Node registered")
			return true, nil
		}
		if !apierrors.IsAlreadyExists(err) {
			s.logger.Error(err, "Registering node, will retry")
			return false, nil
		}
		existing, err := s.client.CoreV1().Nodes().Get(ctx, s.cfg.nodeName, metav1.GetOptions{})
		if err != nil {
			s.logger.Error(err, "Getting existing node, will retry")
			return false, nil
		}
		missing := map[string]string{}
		for k, v := range s.ownLabels() {
			if existing.Labels[k] != v {
				missing[k] = v
			}
		}
		if len(missing) > 0 {
			patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": missing}})
			if _, err := s.client.CoreV1().Nodes().Patch(ctx, s.cfg.nodeName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
				s.logger.Error(err, "Labelling existing node, will retry")
				return false, nil
			}
		}
		if resetExtended {
			// No device-manager checkpoint: a new node under an old name, so
			// extended resources start from zero (kubelet reconcileExtendedResource).
			updated := existing.DeepCopy()
			for _, rl := range []v1.ResourceList{updated.Status.Capacity, updated.Status.Allocatable} {
				for name := range rl {
					if v1helper.IsExtendedResourceName(name) {
						rl[name] = *resource.NewQuantity(0, resource.DecimalSI)
					}
				}
			}
			if _, _, err := nodeutil.PatchNodeStatus(s.client.CoreV1(), types.NodeName(s.cfg.nodeName), existing, updated); err != nil {
				s.logger.Error(err, "Resetting extended resources, will retry")
				return false, nil
			}
		}
		s.logger.Info("Node already registered, adopted it")
		return true, nil
	})
}

// nodeStatusLoop keeps the Ready condition fresh and republishes capacity
// whenever the device manager's changes (plugin registered, ListAndWatch
// update, plugin gone for longer than the endpoint grace period).
func (s *standin) nodeStatusLoop(ctx context.Context) {
	var (
		lastCap, lastAlloc v1.ResourceList
		lastBeat           time.Time
		failed             bool
		zeroed             = sets.New[string]() // removed device-plugin resources
	)
	t := time.NewTicker(s.cfg.capacityPoll)
	defer t.Stop()
	for {
		capacity, allocatable, removed := s.dm.GetCapacity()
		zeroed.Insert(removed...)
		for name := range capacity {
			zeroed.Delete(string(name))
		}
		changed := len(removed) > 0 || !apiequality.Semantic.DeepEqual(capacity, lastCap) ||
			!apiequality.Semantic.DeepEqual(allocatable, lastAlloc)
		if changed || failed || time.Since(lastBeat) >= s.cfg.heartbeat {
			if changed {
				s.logger.Info("Device plugin capacity", "capacity", capacity, "allocatable", allocatable, "removed", sets.List(zeroed))
			}
			if err := s.updateNodeStatus(ctx, capacity, allocatable, zeroed); err != nil {
				if ctx.Err() != nil {
					return
				}
				s.logger.Error(err, "Updating node status, will retry")
				failed = true
			} else {
				lastCap, lastAlloc, lastBeat, failed = capacity, allocatable, time.Now(), false
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// updateNodeStatus is kubelet tryUpdateNodeStatus: read the Node, set the
// status fields this kubelet owns, patch the status subresource with the
// difference (metadata written by others is never sent back).
func (s *standin) updateNodeStatus(ctx context.Context, capacity, allocatable v1.ResourceList, zeroed sets.Set[string]) error {
	old, err := s.client.CoreV1().Nodes().Get(ctx, s.cfg.nodeName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		s.logger.Info("Node object is gone, registering it again")
		if err := s.registerNode(ctx, false); err != nil {
			return err
		}
		old, err = s.client.CoreV1().Nodes().Get(ctx, s.cfg.nodeName, metav1.GetOptions{})
	}
	if err != nil {
		return err
	}
	node := old.DeepCopy()
	s.setNodeStatus(node, capacity, allocatable, time.Now())
	for name := range zeroed {
		node.Status.Capacity[v1.ResourceName(name)] = *resource.NewQuantity(0, resource.DecimalSI)
		node.Status.Allocatable[v1.ResourceName(name)] = *resource.NewQuantity(0, resource.DecimalSI)
	}
	if _, _, err := nodeutil.PatchNodeStatus(s.client.CoreV1(), types.NodeName(s.cfg.nodeName), old, node); err != nil {
		return fmt.Errorf("patching node status: %w", err)
	}
	return nil
}

// setNodeStatus applies the kubelet's node status setters that matter here.
func (s *standin) setNodeStatus(node *v1.Node, devCapacity, devAllocatable v1.ResourceList, now time.Time) {
	st := &node.Status
	if st.Capacity == nil {
		st.Capacity = v1.ResourceList{}
	}
	if st.Allocatable == nil {
		st.Allocatable = v1.ResourceList{}
	}
	c := s.cfg.capacity
	for name, q := range map[v1.ResourceName]resource.Quantity{
		v1.ResourceCPU: c.cpu, v1.ResourceMemory: c.memory, v1.ResourcePods: c.pods, v1.ResourceEphemeralStorage: c.ephemeralStorage,
	} {
		st.Capacity[name], st.Allocatable[name] = q.DeepCopy(), q.DeepCopy()
	}
	for name, q := range devCapacity {
		st.Capacity[name] = q.DeepCopy()
	}
	for name, q := range devAllocatable {
		st.Allocatable[name] = q.DeepCopy()
	}
	st.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: s.cfg.nodeIP}, {Type: v1.NodeHostName, Address: s.cfg.nodeName}}
	st.NodeInfo.KubeletVersion = kubeletVersion()
	st.NodeInfo.OperatingSystem, st.NodeInfo.Architecture = runtime.GOOS, runtime.GOARCH
	st.NodeInfo.ContainerRuntimeVersion = "kubelet-standin://" + kubeletVersion()
	st.NodeInfo.OSImage, st.NodeInfo.KernelVersion = "kubelet-standin", "none"
	beat := metav1.NewTime(now)
	setNodeCondition(st, v1.NodeMemoryPressure, v1.ConditionFalse, "KubeletHasSufficientMemory", "kubelet has sufficient memory available", beat)
	setNodeCondition(st, v1.NodeDiskPressure, v1.ConditionFalse, "KubeletHasNoDiskPressure", "kubelet has no disk pressure", beat)
	setNodeCondition(st, v1.NodePIDPressure, v1.ConditionFalse, "KubeletHasSufficientPID", "kubelet has sufficient PID available", beat)
	setNodeCondition(st, v1.NodeReady, v1.ConditionTrue, "KubeletReady", "kubelet is posting ready status", beat)
}

func setNodeCondition(st *v1.NodeStatus, t v1.NodeConditionType, status v1.ConditionStatus, reason, message string, now metav1.Time) {
	c := v1.NodeCondition{Type: t, Status: status, Reason: reason, Message: message, LastHeartbeatTime: now, LastTransitionTime: now}
	for i := range st.Conditions {
		if st.Conditions[i].Type == t {
			if st.Conditions[i].Status == status {
				c.LastTransitionTime = st.Conditions[i].LastTransitionTime
			}
			st.Conditions[i] = c
			return
		}
	}
	st.Conditions = append(st.Conditions, c)
}
