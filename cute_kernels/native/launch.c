/* The kept launch of a compiled kernel in one C call: the outputs allocated by torch, the arguments set, the
 * kernel's TVM-FFI entry called on torch's current stream, the outputs returned.
 *
 * Python pays about a torch.add for each torch.empty_like and again for the TVM-FFI call's generic argument setup;
 * this entry does the same work from C through the DLPack exchange API torch publishes
 * (torch.Tensor.__dlpack_c_exchange_api__): torch tensors in as DLTensor views, outputs from torch's allocator.
 *
 * Launch(fn, plan, api, tensor_type, length) where plan holds one entry a kernel argument, in kernel order:
 *   an int i >= 0: the call's argument i (a torch tensor, None or a float);
 *   an int -1 - i: a new output allocated like the call's argument i (shape, dtype, device; compact);
 *   anything else (None, a torch tensor): that object, bound.
 * Calling it returns a tuple of `length` entries: its outputs in plan order, then None. Any refusal (a bad
 * argument type, the entry's own checks, an allocation) raises with nothing launched and no output kept.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#define MAX_ARGS 32
#define MAX_OUTPUTS 4

typedef struct {
  PyObject_HEAD
  PyObject* fn;       /* the tvm_ffi.Function, kept alive */
  void* handle;       /* its TVMFFIObjectHandle */
  PyObject* plan;     /* tuple, one entry a kernel argument */
  PyTypeObject* tensor_type;
  const DLPackExchangeAPI* api;
  int num_args;
  int num_outputs;
  int length;
  int max_source; /* the highest call argument index the plan reads, +1 */
} Launch;

static void launch_dealloc(Launch* self) {
  Py_XDECREF(self->fn);
  Py_XDECREF(self->plan);
  Py_XDECREF((PyObject*)self->tensor_type);
  Py_TYPE(self)->tp_free((PyObject*)self);
}

static void alloc_error(void* ctx, const char* kind, const char* message) {
  (void)ctx;
  PyErr_Format(PyExc_RuntimeError, "output allocation failed: %s: %s", kind, message);
}

/* Raise the pending TVM-FFI error as a RuntimeError naming `what`, its kind and message (and clear it). */
static void raise_ffi_error(const char* what) {
  TVMFFIObjectHandle error = NULL;
  TVMFFIErrorMoveFromRaised(&error);
  if (error == NULL) {
    PyErr_Format(PyExc_RuntimeError, "%s", what);
    return;
  }
  const TVMFFIErrorCell* cell = (const TVMFFIErrorCell*)((const char*)error + sizeof(TVMFFIObject));
  PyObject* kind = PyUnicode_DecodeUTF8(cell->kind.data, (Py_ssize_t)cell->kind.size, "replace");
  PyObject* message = PyUnicode_DecodeUTF8(cell->message.data, (Py_ssize_t)cell->message.size, "replace");
  TVMFFIObjectDecRef(error);
  if (kind != NULL && message != NULL) PyErr_Format(PyExc_RuntimeError, "%s: %U: %U", what, kind, message);
  Py_XDECREF(kind);
  Py_XDECREF(message);
}

/* One call argument as a TVMFFIAny (tensors through `dl`, which must outlive the call). */
static int set_value(Launch* self, PyObject* obj, TVMFFIAny* out, DLTensor* dl) {
  out->zero_padding = 0;
  out->v_int64 = 0;
  if (obj == Py_None) {
    out->type_index = kTVMFFINone;
    return 0;
  }
  if (PyFloat_CheckExact(obj)) {
    out->type_index = kTVMFFIFloat;
    out->v_float64 = PyFloat_AS_DOUBLE(obj);
    return 0;
  }
  if (PyObject_TypeCheck(obj, self->tensor_type)) {
    if (self->api->dltensor_from_py_object_no_sync(obj, dl) != 0) return -1;
    out->type_index = kTVMFFIDLTensorPtr;
    out->v_ptr = dl;
    return 0;
  }
  PyErr_Format(PyExc_TypeError, "a kernel argument must be a tensor, None or a float, got %s",
               Py_TYPE(obj)->tp_name);
  return -1;
}

static PyObject* launch_call(Launch* self, PyObject* args, PyObject* kwargs) {
  if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "the launch takes positional arguments only");
    return NULL;
  }
  if (self->handle == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "the launch was not initialised");
    return NULL;
  }
  const int length = self->length;
  Py_ssize_t nargs = PyTuple_GET_SIZE(args);
  if (nargs != self->max_source) {
    PyErr_Format(PyExc_TypeError, "the launch takes %d arguments, got %zd", self->max_source, nargs);
    return NULL;
  }
  DLTensor dl[MAX_ARGS];
  TVMFFIAny packed[MAX_ARGS];
  DLManagedTensorVersioned* outputs[MAX_OUTPUTS];
  int made = 0;
  int device_type = -1, device_id = 0;
  for (int k = 0; k < self->num_args; ++k) {
    PyObject* entry = PyTuple_GET_ITEM(self->plan, k);
    if (PyLong_CheckExact(entry)) {
      long i = PyLong_AsLong(entry);
      if (i >= 0) {
        if (set_value(self, PyTuple_GET_ITEM(args, i), &packed[k], &dl[k]) != 0) goto fail;
      } else {
        DLTensor proto;
        if (set_value(self, PyTuple_GET_ITEM(args, -1 - i), &packed[k], &proto) != 0) goto fail;
        if (packed[k].type_index != kTVMFFIDLTensorPtr) {
          PyErr_SetString(PyExc_TypeError, "an output is allocated like a tensor argument");
          goto fail;
        }
        proto.strides = NULL;
        proto.byte_offset = 0;
        proto.data = NULL;
        if (self->api->managed_tensor_allocator(&proto, &outputs[made], NULL, alloc_error) != 0) goto fail;
        ++made;
        dl[k] = outputs[made - 1]->dl_tensor;
        packed[k].v_ptr = &dl[k];
      }
    } else if (set_value(self, entry, &packed[k], &dl[k]) != 0) {
      goto fail;
    }
    if (device_type == -1 && packed[k].type_index == kTVMFFIDLTensorPtr && dl[k].device.device_type != kDLCPU) {
      device_type = dl[k].device.device_type;
      device_id = dl[k].device.device_id;
    }
  }
  {
    TVMFFIStreamHandle stream = NULL, previous = NULL;
    int set_stream = device_type != -1 && self->api->current_work_stream != NULL;
    if (set_stream) {
      if (self->api->current_work_stream((DLDeviceType)device_type, device_id, &stream) != 0) goto fail;
      if (TVMFFIEnvSetStream(device_type, device_id, stream, &previous) != 0) {
        raise_ffi_error("setting the TVM-FFI stream");
        goto fail;
      }
    }
    TVMFFIAny result;
    result.type_index = kTVMFFINone;
    result.zero_padding = 0;
    result.v_int64 = 0;
    int rc;
    /* As TVM-FFI's own Python calls do: a launch can block (a full launch queue) while another thread's launch is
     * what lets this stream drain. The arguments are DLTensor views on this stack; their tensors stay referenced. */
    Py_BEGIN_ALLOW_THREADS;
    rc = TVMFFIFunctionCall(self->handle, packed, self->num_args, &result);
    Py_END_ALLOW_THREADS;
    if (rc != 0) raise_ffi_error("the kernel's entry refused the call");
    if (set_stream && previous != stream && TVMFFIEnvSetStream(device_type, device_id, previous, NULL) != 0) {
      if (rc == 0) {
        if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
        raise_ffi_error("restoring the TVM-FFI stream");
        goto fail;
      }
      TVMFFIObjectHandle ignored = NULL;
      TVMFFIErrorMoveFromRaised(&ignored);
      if (ignored != NULL) TVMFFIObjectDecRef(ignored);
    }
    if (rc != 0) goto fail;
    if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
  }
  {
    PyObject* tuple = PyTuple_New(length);
    if (tuple == NULL) goto fail;
    for (int j = made; j < length; ++j) {
      Py_INCREF(Py_None);
      PyTuple_SET_ITEM(tuple, j, Py_None);
    }
    for (int j = 0; j < made; ++j) {
      void* obj = NULL;
      if (self->api->managed_tensor_to_py_object_no_sync(outputs[j], &obj) != 0 || obj == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "an output could not become a tensor");
        /* outputs[j] is consumed either way (the producer owns it from here); free the rest */
        for (int r = j + 1; r < made; ++r) outputs[r]->deleter(outputs[r]);
        Py_DECREF(tuple);
        return NULL;
      }
      PyTuple_SET_ITEM(tuple, j, (PyObject*)obj);
    }
    return tuple;
  }
fail:
  for (int j = 0; j < made; ++j) outputs[j]->deleter(outputs[j]);
  return NULL;
}

static int launch_init(Launch* self, PyObject* args, PyObject* kwargs) {
  PyObject *fn, *plan, *capsule, *tensor_type;
  int length;
  if (self->handle != NULL) {  /* a kernel that re-initialised its own launch mid-call would pull the plan away */
    PyErr_SetString(PyExc_RuntimeError, "a launch is initialised once");
    return -1;
  }
  static char* names[] = {"fn", "plan", "api", "tensor_type", "length", NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OO!i", names, &fn, &PyTuple_Type, &plan, &capsule,
                                   &PyType_Type, &tensor_type, &length))
    return -1;
  PyObject* h = PyObject_CallMethod(fn, "__chandle__", NULL);
  if (h == NULL) return -1;
  void* handle = PyLong_AsVoidPtr(h);
  Py_DECREF(h);
  if (handle == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "fn has no TVM-FFI handle");
    return -1;
  }
  if (((const TVMFFIObject*)handle)->type_index != kTVMFFIFunction) {
    PyErr_SetString(PyExc_TypeError, "fn must be a TVM-FFI function");
    return -1;
  }
  const DLPackExchangeAPI* api = (const DLPackExchangeAPI*)PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
  if (api == NULL) return -1;
  if (api->header.version.major != DLPACK_MAJOR_VERSION || api->managed_tensor_allocator == NULL ||
      api->dltensor_from_py_object_no_sync == NULL || api->managed_tensor_to_py_object_no_sync == NULL) {
    PyErr_SetString(PyExc_ValueError, "the DLPack exchange API lacks what the launch needs");
    return -1;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(plan);
  if (n > MAX_ARGS) {
    PyErr_Format(PyExc_ValueError, "at most %d kernel arguments, got %zd", MAX_ARGS, n);
    return -1;
  }
  int outputs = 0, max_source = 0;
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* entry = PyTuple_GET_ITEM(plan, k);
    if (!PyLong_CheckExact(entry)) continue;
    long i = PyLong_AsLong(entry);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0) {
      ++outputs;
      i = -1 - i;
    }
    if (i >= MAX_ARGS) {
      PyErr_Format(PyExc_ValueError, "a plan entry names call argument %ld (at most %d)", i, MAX_ARGS - 1);
      return -1;
    }
    if (i + 1 > max_source) max_source = (int)(i + 1);
  }
  if (outputs > MAX_OUTPUTS || length < outputs) {
    PyErr_Format(PyExc_ValueError, "%d outputs (at most %d) in a result of %d", outputs, MAX_OUTPUTS, length);
    return -1;
  }
  Py_INCREF(fn);
  Py_INCREF(plan);
  Py_INCREF(tensor_type);
  Py_XSETREF(self->fn, fn);
  Py_XSETREF(self->plan, plan);
  Py_XSETREF(self->tensor_type, (PyTypeObject*)tensor_type);
  self->handle = handle;
  self->api = api;
  self->num_args = (int)n;
  self->num_outputs = outputs;
  self->max_source = max_source;
  self->length = length;
  return 0;
}

static PyTypeObject LaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_mhc_launch.Launch",
    .tp_basicsize = sizeof(Launch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A compiled kernel's launch with its outputs allocated in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)launch_init,
    .tp_dealloc = (destructor)launch_dealloc,
    .tp_call = (ternaryfunc)launch_call,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_mhc_launch", .m_size = -1};

PyMODINIT_FUNC PyInit__mhc_launch(void) {
  if (PyType_Ready(&LaunchType) < 0) return NULL;
  PyObject* m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  Py_INCREF(&LaunchType);
  if (PyModule_AddObject(m, "Launch", (PyObject*)&LaunchType) < 0) {
    Py_DECREF(&LaunchType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
