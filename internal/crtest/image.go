// SPDX-License-Identifier: Apache-2.0

package crtest

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"
)

// ImageName is the one image of a test runtime: busybox as the pod sandbox
// (pause) image and as every container's image. No registry is reachable
// from the machines the tests run on, so it is built from the host's
// busybox-static and imported.
const ImageName = "fairshare.test/busybox:1"

// busyboxApplets are the commands the image provides, as links to busybox.
var busyboxApplets = []string{"sh", "sleep", "nc", "cat", "echo", "true", "ls"}

// writeImage writes an OCI image layout archive holding one layer (busybox
// at /bin/busybox and its applets) to w. Its entrypoint sleeps forever, which
// is all a pause container does.
func writeImage(w io.Writer, busybox string) error {
	bin, err := os.ReadFile(busybox)
	if err != nil {
		return fmt.Errorf("reading busybox: %w", err)
	}
	files := []LayerFile{{Name: "bin/", Dir: true}, {Name: "bin/busybox", Mode: 0o755, Data: bin}}
	for _, a := range busyboxApplets {
		files = append(files, LayerFile{Name: "bin/" + a, Link: "busybox"})
	}
	return WriteImage(w, ImageName, files, ImageConfig{Entrypoint: []string{"/bin/sleep", "infinity"}})
}

// LayerFile is one entry of an image's layer.
type LayerFile struct {
	// Name is the path in the image, without the leading slash; a
	// directory's ends in one.
	Name string
	Dir  bool
	// Link, if set, makes a symbolic link to it.
	Link string
	Mode int64
	Data []byte
}

// ImageConfig is the part of an OCI image configuration's "config" the
// tests' images set (the Dockerfile's ENTRYPOINT, CMD and ENV).
type ImageConfig struct {
	Entrypoint []string `json:"Entrypoint,omitempty"`
	Cmd        []string `json:"Cmd,omitempty"`
	Env        []string `json:"Env,omitempty"`
}

// WriteImage writes an OCI image layout archive (oci-layout, index.json and
// the blobs: one uncompressed layer, the configuration for linux/amd64, the
// manifest) to w, the image named name (the io.containerd.image.name
// annotation `ctr images import` names it by). It is what `docker build`
// and `docker save` would make of a FROM scratch Dockerfile, made without a
// Docker daemon. Every time stamp is the epoch, so equal inputs give equal
// archives.
func WriteImage(w io.Writer, name string, files []LayerFile, cfg ImageConfig) error {
	var layer bytes.Buffer
	lt := tar.NewWriter(&layer)
	mt := time.Unix(0, 0)
	for _, f := range files {
		h := &tar.Header{Name: f.Name, Typeflag: tar.TypeReg, Mode: f.Mode, Size: int64(len(f.Data)), ModTime: mt}
		switch {
		case f.Dir:
			h.Typeflag, h.Mode, h.Size = tar.TypeDir, 0o755, 0
		case f.Link != "":
			h.Typeflag, h.Linkname, h.Mode, h.Size = tar.TypeSymlink, f.Link, 0o777, 0
		}
		if err := lt.WriteHeader(h); err != nil {
			return err
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := lt.Write(f.Data); err != nil {
				return err
			}
		}
	}
	if err := lt.Close(); err != nil {
		return err
	}

	type desc struct {
		MediaType   string            `json:"mediaType"`
		Digest      string            `json:"digest"`
		Size        int               `json:"size"`
		Annotations map[string]string `json:"annotations,omitempty"`
	}
	blobs := map[string][]byte{}
	put := func(mediaType string, b []byte) desc {
		sum := sha256.Sum256(b)
		d := "sha256:" + hex.EncodeToString(sum[:])
		blobs[d] = b
		return desc{MediaType: mediaType, Digest: d, Size: len(b)}
	}
	layerDesc := put("application/vnd.oci.image.layer.v1.tar", layer.Bytes())
	cfgJSON, err := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"config": cfg,
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{layerDesc.Digest}},
	})
	if err != nil {
		return err
	}
	cfgDesc := put("application/vnd.oci.image.config.v1+json", cfgJSON)
	man, _ := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": cfgDesc, "layers": []desc{layerDesc},
	})
	manDesc := put("application/vnd.oci.image.manifest.v1+json", man)
	manDesc.Annotations = map[string]string{"io.containerd.image.name": name}
	index, _ := json.Marshal(map[string]any{"schemaVersion": 2, "manifests": []desc{manDesc}})

	ot := tar.NewWriter(w)
	file := func(name string, b []byte) error {
		if err := ot.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(b)), ModTime: mt}); err != nil {
			return err
		}
		_, err := ot.Write(b)
		return err
	}
	if err := file("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return err
	}
	if err := file("index.json", index); err != nil {
		return err
	}
	for d, b := range blobs {
		if err := file("blobs/sha256/"+d[len("sha256:"):], b); err != nil {
			return err
		}
	}
	return ot.Close()
}
