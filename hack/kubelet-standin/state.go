package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
)

// stateFile is the JSON contract documented in main.go.
type stateFile struct {
	Node string               `json:"node"`
	Pods map[string]*podState `json:"pods"`
}

type podState struct {
	UID        string                     `json:"uid"`
	Phase      string                     `json:"phase"`
	Reason     string                     `json:"reason,omitempty"`
	Message    string                     `json:"message,omitempty"`
	Containers map[string]*containerState `json:"containers,omitempty"`
}

type containerState struct {
	Init        bool                `json:"init,omitempty"`
	Env         map[string]string   `json:"env"`
	Devices     map[string][]string `json:"devices"`
	DeviceSpecs []deviceSpec        `json:"deviceSpecs"`
	Mounts      []mountSpec         `json:"mounts,omitempty"`
	Annotations map[string]string   `json:"annotations,omitempty"`
	CDIDevices  []string            `json:"cdiDevices,omitempty"`
}

type deviceSpec struct {
	ContainerPath string `json:"containerPath"`
	HostPath      string `json:"hostPath"`
	Permissions   string `json:"permissions"`
}

type mountSpec struct {
	ContainerPath string `json:"containerPath"`
	HostPath      string `json:"hostPath"`
	ReadOnly      bool   `json:"readOnly"`
}

// state is the in-memory state file; only the pod worker touches it after
// startup.
type state struct {
	path    string
	data    stateFile
	written []byte
}

func loadState(path, node string) (*state, error) {
	s := &state{path: path, data: stateFile{Node: node, Pods: map[string]*podState{}}}
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return s, s.flush()
	}
	if err != nil {
		return nil, err
	}
	var old stateFile
	if err := json.Unmarshal(b, &old); err != nil {
		klog.ErrorS(err, "Ignoring unreadable state file", "path", path)
		return s, s.flush()
	}
	if old.Node != node {
		klog.InfoS("Ignoring state file of another node", "path", path, "stateNode", old.Node)
		return s, s.flush()
	}
	if old.Pods != nil {
		s.data.Pods = old.Pods
	}
	s.written = b
	return s, nil
}

// flush writes the state file if it changed: tmp file + rename, so readers
// never see a partial file.
func (s *state) flush() error {
	b, err := json.MarshalIndent(&s.data, "", "  ")
	if err != nil {
		return err
	}
	b = append(b, '\n')
	if bytes.Equal(b, s.written) {
		return nil
	}
	tmp, err := os.CreateTemp(filepath.Dir(s.path), "."+filepath.Base(s.path)+".tmp*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), s.path); err != nil {
		return fmt.Errorf("writing state file: %w", err)
	}
	s.written = b
	return nil
}

// containerFacts records what the runtime would have been given for a
// container: the device manager's run options and the device IDs it holds.
func containerFacts(opts *devicemanager.DeviceRunContainerOptions, devs devicemanager.ResourceDeviceInstances) *containerState {
	c := &containerState{Env: map[string]string{}, Devices: map[string][]string{}, DeviceSpecs: []deviceSpec{}}
	for res, ids := range devs {
		list := make([]string, 0, len(ids))
		for id := range ids {
			list = append(list, id)
		}
		sort.Strings(list)
		c.Devices[res] = list
	}
	if opts == nil {
		return c
	}
	for _, e := range opts.Envs {
		c.Env[e.Name] = e.Value
	}
	for _, d := range opts.Devices {
		c.DeviceSpecs = append(c.DeviceSpecs, deviceSpec{ContainerPath: d.PathInContainer, HostPath: d.PathOnHost, Permissions: d.Permissions})
	}
	for _, m := range opts.Mounts {
		c.Mounts = append(c.Mounts, mountSpec{ContainerPath: m.ContainerPath, HostPath: m.HostPath, ReadOnly: m.ReadOnly})
	}
	for _, d := range opts.CDIDevices {
		c.CDIDevices = append(c.CDIDevices, d.Name)
	}
	for _, a := range opts.Annotations {
		if c.Annotations == nil {
			c.Annotations = map[string]string{}
		}
		c.Annotations[a.Name] = a.Value
	}
	return c
}
